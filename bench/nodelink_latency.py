"""Idle submit -> running latency on the real stack (``python -m bench.nodelink_latency [N]``).

The same measurement as the vs-slurm benchmark's idle latency (bench.side_by_side.latency_run),
alone, so the cost of signing commands and acknowledging reports can be compared before/after
on one machine. Prints p50/p95 in seconds as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> None:
    from bench.side_by_side import Ours, latency_run
    from bench.stack import Stack
    from bench.stats import median

    n = int(argv[0]) if argv else 30
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-nodelink-bench-"))
    stack = Stack(workdir / "stack").start()
    try:
        ours = Ours(stack)
        latency_run(ours.submit_one, [1000] * 3, workdir / "warm")  # warm up the stack
        lat = sorted(latency_run(ours.submit_one, [1000] * n, workdir / "stamps"))
        print(json.dumps({"n": n, "p50_s": round(median(lat), 4), "p95_s": round(lat[int(0.95 * (n - 1))], 4)}))
    finally:
        stack.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
