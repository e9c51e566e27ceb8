"""Benchmark (not part of the suite): what a budget check costs with a month of usage windows.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gs_accounts REDIS_URL=redis://127.0.0.1:6379/1 \\
        .venv/bin/pytest tests/accounts/bench_month_usage.py -q -s

Inserts WINDOWS settled windows for one budgeted tenant, then times the reads the scheduler
(every pass) and job_submit (every submit) make, before and after the month totals are folded.
"""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from django.db import connection, transaction

from accounts.services import quota_set
from admission.selectors import month_bounds_ms, month_usage
from admission.selectors import tenant_caps_for_scheduling as tenant_limits_for_scheduling
from admission.services import month_usage_advance
from tests.accounts.helpers import job_make, node_get, submission_check

WINDOWS = 300_000


def timed(label: str, func):
    start = time.perf_counter()
    result = func()
    print(f"{label:<50} {(time.perf_counter() - start) * 1000:8.1f} ms")
    return result


@pytest.mark.django_db
def test_month_usage_cost(rules, tenant):
    job, node = job_make(tenant), node_get()
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal(1_000_000))
    start, _ = month_bounds_ms()
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO billing_usagewindow (tenant_id, job_id, node_id, attempt, seq, start_ms, end_ms, gpu_model,
                   mode, gpu_ms, sm_util_ms, memory_avg_mb, memory_peak_mb, energy_mj, priority_class, amount,
                   received_at)
               SELECT %s, %s, %s, 1, g, %s + g * 1000, %s + g * 1000 + 1000, 'H100-80GB', 'dedicated', 1000, 0, 0, 0,
                   0, '', 0.0007, now() - interval '1 hour' + g * interval '1 millisecond'
               FROM generate_series(1, %s) g""",
            [tenant.pk, job.pk, node.pk, start, start, WINDOWS],
        )
        cursor.execute("ANALYZE billing_usagewindow")
    print(f"\n{WINDOWS} usage windows this month")
    before = timed("month_usage, no month totals yet", lambda: month_usage(tenant))
    timed("tenant_limits_for_scheduling, no month totals yet", tenant_limits_for_scheduling)
    with transaction.atomic():
        timed("month_usage_advance (folds them all)", lambda: month_usage_advance([tenant.pk]))
    after = timed("month_usage with month totals", lambda: month_usage(tenant))
    timed("tenant_limits_for_scheduling with month totals", tenant_limits_for_scheduling)
    timed(
        "submission_check with month totals", lambda: submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
    )
    assert before == after
