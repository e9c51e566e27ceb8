"""Benchmark: closing a month into invoices vs the same aggregation as one SQL query.

Data: T tenants with one job each and W usage windows (and their charges) in
the current month, generated in PostgreSQL from one window that went through
the real ingest service (so every column is what ingest writes). The issue
asks for 1,000 tenants and 10 million windows; the default run uses 500,000
(generating 10 million rows twice takes longer than the whole 15-minute
budget on 2 cores): ``BENCH_INVOICE_WINDOWS=10000000 python -m bench --only
invoice`` runs the full size. Charges come in batches of 200 windows of one
job, as ingest writes them (one batch per agent message). Ours:
billing.services.invoices_close_month (one transaction for all tenants: lock
them, create the invoices, mark the batches and sum their charges into lines
in one statement). Reference: one GROUP BY over the same uninvoiced charges
(charges joined to their batches); the log also shows the GROUP BY with no
test of invoicing at all.
Goal: <= 2x the raw query.
"""

from __future__ import annotations

import os
import time
from decimal import Decimal

from .fixtures import finished_jobs_create
from .ingest import columns
from .stats import Row

# Uninvoiced = in a batch not yet on an invoice (billing.models.ChargeBatch).
RAW_QUERY = """
SELECT c.tenant_id, c.gpu_model, c.mode, c.priority_class, c.rate_per_gpu_hour,
       SUM(c.gpu_ms), SUM(c.sm_util_ms), SUM(c.memory_mb_ms), SUM(c.energy_mj), SUM(c.amount)
FROM billing_charge c JOIN billing_chargebatch b ON b.id = c.batch_id
WHERE b.invoice_id IS NULL AND c.month <= %s
GROUP BY c.tenant_id, c.gpu_model, c.mode, c.priority_class, c.rate_per_gpu_hour
"""
# The same sums with no test of invoicing at all: the floor any close stands on.
PLAIN_QUERY = """
SELECT tenant_id, gpu_model, mode, priority_class, rate_per_gpu_hour,
       SUM(gpu_ms), SUM(sm_util_ms), SUM(memory_mb_ms), SUM(energy_mj), SUM(amount)
FROM billing_charge WHERE month <= %s
GROUP BY tenant_id, gpu_model, mode, priority_class, rate_per_gpu_hour
"""
# Ingest writes one batch per 200-window message (one job's windows).
WINDOWS_PER_BATCH = 200


def select_list(cols: list[str], overrides: dict[str, str], alias: str) -> str:
    """``alias.col`` for each column, or its override expression."""
    return ", ".join(overrides.get(c, f"{alias}.{c}") for c in cols)


def data_generate(ctx, stack, *, tenants: int, windows: int) -> dict:
    from django.db import connection, transaction
    from django_scopes import scopes_disabled

    from accounts.models import Tenant
    from agents.models import Node
    from billing.models import Charge, UsageWindow
    from billing.services.ingest import usage_windows_ingest

    t0 = time.perf_counter()
    with scopes_disabled():
        made = Tenant.objects.bulk_create(Tenant(slug=f"inv-{i}", name=f"Invoice bench {i}") for i in range(tenants))
        tenant_ids = [t.pk for t in made]
        job_ids = finished_jobs_create(node_name=stack.config.node, count=tenants, tenant_ids=tenant_ids)
        node = Node.objects.get(name=stack.config.node)
        base = int(time.time() * 1000) - windows // tenants * 1000 - 3_600_000
        template = {
            "job_id": job_ids[0],
            "attempt": 1,
            "seq": 0,
            "start_ms": base - 1000,
            "end_ms": base,
            "sm_util_ms": 400,
            "memory_avg_mb": 1000,
            "memory_peak_mb": 2000,
            "energy_mj": 300_000,
        }
        result = usage_windows_ingest(node=node, windows=[template])
        if result.get("stored") != 1:
            raise RuntimeError(f"the template window was not stored: {result}")
        window = UsageWindow.objects.get(job_id=job_ids[0], seq=0)
        charge = Charge.objects.get(window=window)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("CREATE TEMP TABLE bench_jobs (idx int PRIMARY KEY, job_id bigint, tenant_id bigint)")
        cur.execute(
            "INSERT INTO bench_jobs SELECT i - 1, j, t FROM unnest(%s::bigint[], %s::bigint[]) WITH ORDINALITY AS "
            "x(j, t, i)",
            [job_ids, [*tenant_ids]],
        )
        wcols = columns(cur, "billing_usagewindow")
        seq = f"(g / {tenants} + 1)"
        wsel = select_list(
            wcols,
            {
                "tenant_id": "m.tenant_id",
                "job_id": "m.job_id",
                "seq": seq,
                "start_ms": f"{base} + {seq} * 1000",
                "end_ms": f"{base} + {seq} * 1000 + 1000",
            },
            "t",
        )
        cur.execute(
            f"INSERT INTO billing_usagewindow ({', '.join(wcols)}) SELECT {wsel} FROM billing_usagewindow t "
            f"CROSS JOIN generate_series(0, %s) g JOIN bench_jobs m ON m.idx = g %% {tenants} WHERE t.id = %s",
            [windows - 2, window.pk],
        )
        per_tenant = windows // tenants + 1
        cur.execute(
            "CREATE TEMP TABLE bench_batches (tenant_id bigint, k int, batch_id bigint, PRIMARY KEY (tenant_id, k))"
        )
        cur.execute(
            "WITH made AS (INSERT INTO billing_chargebatch (tenant_id, month, created_at) "
            "SELECT m.tenant_id, %s, now() FROM bench_jobs m CROSS JOIN generate_series(0, %s) k "
            "RETURNING id, tenant_id) "
            "INSERT INTO bench_batches "
            "SELECT tenant_id, row_number() OVER (PARTITION BY tenant_id ORDER BY id) - 1, id FROM made",
            [charge.month, per_tenant // WINDOWS_PER_BATCH],
        )
        ccols = columns(cur, "billing_charge")
        csel = select_list(
            ccols,
            {
                "tenant_id": "w.tenant_id",
                "window_id": "w.id",
                "job_id": "w.job_id",
                "start_ms": "w.start_ms",
                "end_ms": "w.end_ms",
                "batch_id": "bb.batch_id",
            },
            "c",
        )
        cur.execute(
            f"INSERT INTO billing_charge ({', '.join(ccols)}) SELECT {csel} FROM billing_charge c "
            "CROSS JOIN billing_usagewindow w JOIN bench_jobs m ON m.job_id = w.job_id "
            f"JOIN bench_batches bb ON bb.tenant_id = w.tenant_id AND bb.k = w.seq / {WINDOWS_PER_BATCH} "
            "WHERE c.id = %s AND w.id <> %s",
            [charge.pk, window.pk],
        )
        cur.execute("DROP TABLE bench_jobs")
        cur.execute("DROP TABLE bench_batches")
    with connection.cursor() as cur:
        cur.execute("ANALYZE billing_usagewindow")
        cur.execute("ANALYZE billing_charge")
        cur.execute("ANALYZE billing_chargebatch")
    seconds = time.perf_counter() - t0
    ctx.log(f"  invoice: {windows:,} windows and charges for {tenants:,} tenants generated in {seconds:.0f}s")
    return {"month": charge.month, "generate_s": seconds}


def run(ctx) -> tuple[list[Row], dict]:
    stack = ctx.stack()
    from django.db import connection
    from django_scopes import scopes_disabled

    from billing.models import Invoice, InvoiceLine
    from billing.services.invoices import invoices_close_month

    tenants = 100 if ctx.quick else 1000
    windows = 100_000 if ctx.quick else int(os.environ.get("BENCH_INVOICE_WINDOWS", "500000"))
    data = data_generate(ctx, stack, tenants=tenants, windows=windows)
    month = data["month"]
    raw_runs = []
    for _ in range(3):
        with connection.cursor() as cur:
            t0 = time.perf_counter()
            cur.execute(RAW_QUERY, [month])
            groups = cur.fetchall()
            raw_runs.append(time.perf_counter() - t0)
    raw_s = sorted(raw_runs)[1]
    plain_runs = []
    for _ in range(3):
        with connection.cursor() as cur:
            t0 = time.perf_counter()
            cur.execute(PLAIN_QUERY, [month])
            cur.fetchall()
            plain_runs.append(time.perf_counter() - t0)
    plain_s = sorted(plain_runs)[1]
    expected_total = sum((g[9] for g in groups), Decimal(0))
    ctx.log(
        f"  invoice: raw aggregation {raw_s:.2f}s (median of 3; {len(groups)} lines); "
        f"without the uninvoiced test {plain_s:.2f}s"
    )
    t0 = time.perf_counter()
    invoices = invoices_close_month(month=month)
    close_s = time.perf_counter() - t0
    with scopes_disabled():
        exact = sum(InvoiceLine.objects.filter(invoice__in=invoices).values_list("exact_amount", flat=True), Decimal(0))
        closed = Invoice.objects.filter(month=month).count()
    if exact != expected_total or len(invoices) != len({g[0] for g in groups}):
        raise RuntimeError(
            f"invoices disagree with the raw query: {exact} vs {expected_total}, "
            f"{len(invoices)} invoices for {len({g[0] for g in groups})} tenants"
        )
    ctx.log(f"  invoice: invoices_close_month {close_s:.1f}s for {closed} invoices")
    rows = [
        Row(
            "invoice",
            f"close month: {tenants:,} tenants, {windows:,} windows",
            close_s,
            "s",
            raw_s,
            "one GROUP BY query",
            higher_is_better=False,
            goal="<= 2x raw query",
            goal_met=close_s <= 2 * raw_s,
            runs=1,
            note="close also writes invoices and lines and marks the charges' batches invoiced",
        ),
    ]
    return rows, {
        "tenants": tenants,
        "windows": windows,
        "raw_s": raw_runs,
        "plain_s": plain_runs,
        "close_s": close_s,
        "invoices": closed,
        "generate_s": data["generate_s"],
        "lines": len(groups),
    }
