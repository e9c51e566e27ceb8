"""Idle submit -> running latency and drain on the real stack
(``python -m bench.nodelink_latency [N] [--drain M]``).

The same measurements as the vs-slurm benchmark's idle latency (bench.side_by_side.latency_run)
and drain (M jobs submitted while the node is cordoned, then released: every launch is a signed
command, every start and exit an acknowledged report), alone, so the cost of signing commands and
acknowledging reports can be compared before/after on one machine. Prints JSON.
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

    drain_n = 0
    if "--drain" in argv:
        at = argv.index("--drain")
        drain_n = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    n = int(argv[0]) if argv else 30
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-nodelink-bench-"))
    stack = Stack(workdir / "stack").start()
    try:
        ours = Ours(stack)
        latency_run(ours.submit_one, [1000] * 3, workdir / "warm")  # warm up the stack
        lat = sorted(latency_run(ours.submit_one, [1000] * n, workdir / "stamps"))
        out = {"n": n, "p50_s": round(median(lat), 4), "p95_s": round(lat[int(0.95 * (n - 1))], 4)}
        if drain_n:
            out.update(drain(ours, drain_n))
        print(json.dumps(out))
    finally:
        stack.stop()


def drain(ours, n: int) -> dict:
    """Seconds from releasing ``n`` held jobs (a mix of whole GPUs and slices) until all have finished."""
    import time

    from bench.side_by_side import submit_timed, wait_until
    from bench.workload import workload

    ours.hold()
    _, ids = submit_timed(ours.submit_one, workload(n), 4)
    start = time.perf_counter()
    ours.release(ids)
    wait_until(lambda: ours.unfinished(ids) == 0, 600)
    seconds = time.perf_counter() - start
    return {"drain_n": n, "drain_s": round(seconds, 2), "drain_per_s": round(n / seconds, 1)}


if __name__ == "__main__":
    main(sys.argv[1:])
