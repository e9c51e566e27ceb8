"""Builders for accounts tests: usage windows in a month, running jobs, quotas."""

from __future__ import annotations

from decimal import Decimal

from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.limits import MS_PER_HOUR
from admission.selectors import month_bounds_ms
from agents.models import Node
from billing.models import UsageWindow
from scheduler.models import Job, JobState
from scheduler.services import JobSpec, job_submit

_seq = iter(range(1, 1_000_000))


def node_get(name: str = "quota-node") -> Node:
    return Node.objects.get_or_create(name=name, defaults={"state": Node.State.UP, "token_hash": "x" * 64})[0]


def job_make(tenant, user=None, *, gpus: int = 1, state: str = JobState.QUEUED, max_runtime_s: int = 60) -> Job:
    """A job through job_submit; a minute's max runtime keeps its money hold small (cents)."""
    spec = JobSpec(kind="training", gpu_milli=gpus * 1000, command=["true"], max_runtime_s=max_runtime_s)
    job = job_submit(tenant=tenant, user=user, spec=spec)
    if state != JobState.QUEUED:
        with scopes_disabled():
            Job.objects.filter(pk=job.pk).update(state=state, node=node_get(), attempt=1, started_at=timezone.now())
            job.refresh_from_db()
    return job


def usage_add(tenant, *, gpu_hours: Decimal | int = 0, amount: Decimal | str = "0", job=None, last_month=False):
    """One usage window of this (or last) month for ``tenant``."""
    start_ms, _ = month_bounds_ms()
    start_ms = start_ms - 10 * 24 * MS_PER_HOUR if last_month else start_ms + 1000
    gpu_ms = int(Decimal(gpu_hours) * MS_PER_HOUR)
    with scopes_disabled():
        job = job or Job.objects.filter(tenant=tenant).first()
        return UsageWindow.objects.create(
            tenant=tenant,
            job=job,
            node=node_get(),
            seq=next(_seq),
            start_ms=start_ms,
            end_ms=start_ms + max(gpu_ms, 1),
            gpu_model="H100-80GB",
            mode="dedicated",
            gpu_ms=gpu_ms,
            amount=Decimal(amount),
        )


def submission_check(*, tenant, mode: str, gpu_milli: int, max_runtime_s: int = 3600, count: int = 1) -> None:
    """The admission check job_submit runs (through the scheduler's port), for a job of this size."""
    from decimal import Decimal

    from scheduler.admission import JobAsk, job_admit

    job_admit(
        tenant=tenant,
        ask=JobAsk(
            kind="training" if mode == "dedicated" else "inference",
            mode=mode,
            gpu_milli=gpu_milli,
            max_runtime_s=max_runtime_s,
            price_multiplier=Decimal(1),
            count=count,
        ),
    )
