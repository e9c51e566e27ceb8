"""Benchmark (not part of the suite): what admission costs per submit, with and without a money budget,
as the tenant's unfinished jobs grow (the open holds are read from them).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gs_admission REDIS_URL=redis://127.0.0.1:6379/1 \\
        .venv/bin/pytest tests/admission/bench_admission.py -q -s
"""

from __future__ import annotations

import time
from decimal import Decimal

import pytest
from django.db import transaction
from django_scopes import scopes_disabled

from accounts.services import quota_set
from scheduler.services import JobSpec, job_submit
from tests.accounts.helpers import submission_check

SPEC = JobSpec(kind="training", gpu_milli=1000, command=["true"], max_runtime_s=60)


def per_call_ms(func, n: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(n):
        with transaction.atomic():
            func()
    return (time.perf_counter() - start) * 1000 / n


@pytest.mark.django_db
def test_admission_cost(rules, tenant, other_tenant):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal(10_000_000))
    print()
    for open_jobs in (0, 100, 1000):
        with scopes_disabled():
            for who in (tenant, other_tenant):
                while who.__class__.objects.get(pk=who.pk) and _open(who) < open_jobs:
                    job_submit(tenant=who, user=None, spec=SPEC)
        budget = per_call_ms(
            lambda: submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000, max_runtime_s=60)
        )
        plain = per_call_ms(
            lambda: submission_check(tenant=other_tenant, mode="dedicated", gpu_milli=1000, max_runtime_s=60)
        )
        print(f"{open_jobs:>5} unfinished jobs: admission {plain:6.2f} ms without a budget, {budget:6.2f} ms with one")


def _open(tenant) -> int:
    from scheduler.models import TERMINAL_STATES, Job

    return Job.objects.filter(tenant=tenant).exclude(state__in=TERMINAL_STATES).count()
