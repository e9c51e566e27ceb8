"""Where an array's drain goes (``python -m bench.drain_timeline [ROUNDS]``).

The vs-slurm benchmark's array drain, alone, with a timeline: 1,000 tasks of 1/8 GPU submitted in one
call while the node is cordoned, released, and drained; then, from the database, each task's
``scheduled_at`` / ``started_at`` / ``finished_at``: how long a placed task waits for its launch, how
long a ``true`` takes to be seen ended, how many of the 64 slots are held every half second, and the
gaps between the passes that placed tasks. Long gaps with every slot free point at the reports of the
last wave (the worker's ``agents.job_events`` in the stack's ``worker.log``); a slow launch at the agent.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TASKS = 1000
BUCKET_S = 0.5


def timeline(rows: list[tuple], t0: float) -> list[str]:
    """Lines describing the drain from the tasks' (scheduled_at, started_at, finished_at)."""
    scheduled = sorted(r[0].timestamp() - t0 for r in rows)
    waits = sorted(r[1].timestamp() - r[0].timestamp() for r in rows)
    runs = sorted(r[2].timestamp() - r[1].timestamp() for r in rows)
    end = max(r[2].timestamp() for r in rows) - t0
    held, at = [], 0.0
    while at < end:
        held.append(sum(1 for r in rows if r[0].timestamp() - t0 <= at < r[2].timestamp() - t0))
        at += BUCKET_S
    passes = sorted(Counter(r[0] for r in rows))
    gaps = [(b - a).total_seconds() * 1000 for a, b in zip(passes, passes[1:], strict=False)]
    p90 = int(len(rows) * 0.9)
    return [
        f"  first placed {scheduled[0]:.2f} s, last placed {scheduled[-1]:.2f} s, last ended {end:.2f} s",
        f"  placed -> started p50 {statistics.median(waits) * 1000:.0f} ms, p90 {waits[p90] * 1000:.0f} ms; "
        f"started -> ended p50 {statistics.median(runs) * 1000:.0f} ms, p90 {runs[p90] * 1000:.0f} ms",
        f"  slots held every {BUCKET_S} s: {' '.join(map(str, held))}",
        f"  {len(passes)} passes placed tasks; gaps between them (ms): {' '.join(f'{g:.0f}' for g in gaps)}",
    ]


def main(argv: list[str]) -> None:
    from django_scopes import scopes_disabled

    from bench.side_by_side import ARRAY_MILLI, Ours, wait_until
    from bench.stack import Stack

    rounds = int(argv[0]) if argv else 2
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-drain-timeline-"))
    stack = Stack(workdir / "stack").start()
    ours = Ours(stack)
    try:
        from scheduler.models import Job

        for n in range(rounds):
            ours.hold()
            ids = ours.array_tasks(ours.submit_array(TASKS, ARRAY_MILLI))
            t0, start = time.time(), time.perf_counter()
            ours.release(ids)
            wait_until(lambda ids=ids: ours.unfinished(ids) == 0, 300, interval=0.05)
            print(f"round {n}: {len(ids)} tasks drained in {time.perf_counter() - start:.2f} s", flush=True)
            with scopes_disabled():
                rows = list(Job.objects.filter(pk__in=ids).values_list("scheduled_at", "started_at", "finished_at"))
            print("\n".join(timeline(rows, t0)), flush=True)
            ours.discard([])
        print(f"logs (worker.log: the report tasks' durations) in {workdir / 'stack'}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
