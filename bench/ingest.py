"""Benchmark: metering ingest through the real path vs COPY of the same rows.

The real path: ``agents.usage`` Celery messages (200 windows each, as the
agent's outbox batches them) on the platform queue, consumed by the bench
stack's worker, which runs billing.services.usage_windows_ingest (node
credential check, job row locks, replay and overlap checks, rating into
charges, bulk insert, job totals). The ceiling: the stored window and charge
rows, COPYed into the same tables again (attempt shifted so the unique
constraint holds). Goal: >= 20,000 windows/s and >= 50% of COPY.
"""

from __future__ import annotations

import io
import time

from agents.agent.brokerconf import REPORT_QUEUE

from .fixtures import finished_jobs_create
from .stats import Row, median, rate

WINDOW_MS = 1000
BATCH = 200


def windows_for(job_ids: list[int], per_job: int, start_ms: int) -> list[list[dict]]:
    """Agent-shaped messages: ``BATCH`` consecutive windows of one job each, jobs interleaved."""
    per_job_msgs = []
    for job_id in job_ids:
        windows = [
            {
                "job_id": job_id,
                "attempt": 1,
                "seq": seq,
                "start_ms": start_ms + seq * WINDOW_MS,
                "end_ms": start_ms + (seq + 1) * WINDOW_MS,
                "sm_util_ms": 500,
                "memory_avg_mb": 1000,
                "memory_peak_mb": 2000,
                "energy_mj": 300_000,
            }
            for seq in range(per_job)
        ]
        per_job_msgs.append([windows[i : i + BATCH] for i in range(0, per_job, BATCH)])
    messages = []
    for i in range(max(len(m) for m in per_job_msgs)):
        messages += [m[i] for m in per_job_msgs if i < len(m)]
    return messages


def columns(cursor, table: str) -> list[str]:
    cursor.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s AND column_name <> 'id' "
        "ORDER BY ordinal_position",
        [table],
    )
    return [r[0] for r in cursor.fetchall()]


def copy_ceiling(job_ids: list[int], shift: int) -> dict:
    """Seconds to COPY the stored windows and their charges into the same tables again."""
    from django.db import connection

    with connection.cursor() as cur:
        raw = cur.connection.cursor()
        wcols = columns(cur, "billing_usagewindow")
        ccols = columns(cur, "billing_charge")
        ids = ",".join(map(str, job_ids))
        wsel = ", ".join(f"attempt + {shift}" if c == "attempt" else c for c in wcols)
        wbuf, cbuf = io.StringIO(), io.StringIO()
        raw.copy_expert(
            f"COPY (SELECT {wsel} FROM billing_usagewindow WHERE job_id IN ({ids}) AND attempt = 1) TO STDOUT", wbuf
        )
        raw.copy_expert(f"COPY (SELECT {', '.join(ccols)} FROM billing_charge WHERE job_id IN ({ids})) TO STDOUT", cbuf)
        rows = wbuf.getvalue().count("\n")
        wbuf.seek(0)
        cbuf.seek(0)
        t0 = time.perf_counter()
        raw.copy_expert(f"COPY billing_usagewindow ({', '.join(wcols)}) FROM STDIN", wbuf)
        t1 = time.perf_counter()
        raw.copy_expert(f"COPY billing_charge ({', '.join(ccols)}) FROM STDIN", cbuf)
        t2 = time.perf_counter()
    return {"rows": rows, "windows_s": t1 - t0, "charges_s": t2 - t1, "seconds": t2 - t0}


def stored(job_ids: list[int], attempt: int = 1) -> int:
    from django_scopes import scopes_disabled

    from billing.models import UsageWindow

    with scopes_disabled():
        return UsageWindow.objects.filter(job_id__in=job_ids, attempt=attempt).count()


def one_run(ctx, stack, *, jobs: int, per_job: int, run: int) -> dict:
    from gpushare.celery import app

    job_ids = finished_jobs_create(tenant_id=stack.tenant_id, node_name=stack.config.node, count=jobs)
    start_ms = int(time.time() * 1000) - per_job * WINDOW_MS - 60_000
    messages = windows_for(job_ids, per_job, start_ms)
    total = jobs * per_job
    creds = {"node": stack.config.node, "token": stack.node_token}
    with app.producer_or_acquire() as producer:
        t0 = time.perf_counter()
        for windows in messages:
            app.send_task("agents.usage", kwargs={**creds, "windows": windows}, queue=REPORT_QUEUE, producer=producer)
        enqueued = time.perf_counter() - t0
    deadline = time.monotonic() + 600
    while (n := stored(job_ids)) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
    if n != total:
        raise RuntimeError(f"ingest stored {n} of {total} windows")
    # Replays are ignored: the same messages again store nothing.
    for windows in messages[:5]:
        app.send_task("agents.usage", kwargs={**creds, "windows": windows}, queue=REPORT_QUEUE)
    time.sleep(3)
    if (after := stored(job_ids)) != total:
        raise RuntimeError(f"replayed windows were stored again: {after} rows for {total} windows")
    ceiling = copy_ceiling(job_ids, shift=1000 * run)
    ctx.log(
        f"  ingest run {run}: {total} windows in {seconds:.1f}s ({rate(total, seconds):,.0f}/s; "
        f"enqueue {enqueued:.1f}s); COPY {ceiling['rows']} windows + charges in {ceiling['seconds']:.2f}s"
    )
    return {
        "windows": total,
        "seconds": seconds,
        "enqueue_s": enqueued,
        "per_s": rate(total, seconds),
        "copy": ceiling,
        "copy_per_s": rate(ceiling["rows"], ceiling["seconds"]),
        "copy_windows_only_per_s": rate(ceiling["rows"], ceiling["windows_s"]),
    }


def run(ctx) -> tuple[list[Row], dict]:
    stack = ctx.stack()
    runs_n = 3
    jobs, per_job = (20, 1000) if ctx.quick else (40, 1000)
    runs = [one_run(ctx, stack, jobs=jobs, per_job=per_job, run=i + 1) for i in range(runs_n)]
    ours = median(r["per_s"] for r in runs)
    ceiling = median(r["copy_per_s"] for r in runs)
    rows = [
        Row(
            "ingest",
            f"windows/s ({jobs * per_job:,} per run)",
            ours,
            "win/s",
            ceiling,
            "COPY windows+charges",
            goal=">= 20,000/s and >= 50% of COPY",
            goal_met=ours >= 20_000 and ours >= 0.5 * ceiling,
            runs=runs_n,
        ),
        Row(
            "ingest",
            "COPY windows only (ceiling)",
            median(r["copy_windows_only_per_s"] for r in runs),
            "win/s",
            runs=runs_n,
        ),
    ]
    return rows, {"runs": runs, "worker_concurrency": stack.config.worker_concurrency}
