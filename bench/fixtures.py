"""Bulk data the benchmarks need, written straight into the bench database.

These rows stand for history (finished jobs and their GPU allocations); the
paths under test (ingest, API, invoice close) then run for real on top.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from django_scopes import scopes_disabled


def finished_jobs_create(
    *, tenant_id: int | None = None, node_name: str, count: int, batch_size: int = 5000, tenant_ids: list[int] = ()
) -> list[int]:
    """``count`` succeeded whole-GPU jobs, each with a (released) allocation on a GPU of ``node_name``.

    The jobs belong to ``tenant_id``, or round-robin to ``tenant_ids``.
    """
    owners = list(tenant_ids) or [tenant_id]
    from agents.models import Gpu
    from scheduler.models import Allocation, Job, JobMode, JobState, PriorityClass

    gpus = list(Gpu.objects.filter(node__name=node_name).order_by("index"))
    if not gpus:
        raise RuntimeError(f"node {node_name} has no GPUs registered")
    node = gpus[0].node
    priority = PriorityClass.objects.get(name="standard")
    now = timezone.now()
    ids: list[int] = []
    with scopes_disabled():
        for start in range(0, count, batch_size):
            jobs = Job.objects.bulk_create(
                Job(
                    tenant_id=owners[(start + i) % len(owners)],
                    name=f"bench-{start + i}",
                    kind="training",
                    mode=JobMode.DEDICATED,
                    gpu_milli=1000,
                    command=["true"],
                    priority=priority,
                    max_runtime_s=3600,
                    state=JobState.SUCCEEDED,
                    node=node,
                    attempt=1,
                    started_at=now,
                    finished_at=now,
                    exit_code=0,
                )
                for i in range(min(batch_size, count - start))
            )
            Allocation.objects.bulk_create(
                Allocation(
                    tenant_id=job.tenant_id,
                    job=job,
                    gpu=gpus[(start + i) % len(gpus)],
                    share_milli=1000,
                    released_at=now,
                )
                for i, job in enumerate(jobs)
            )
            ids += [job.pk for job in jobs]
        # They ran for the last day: ingest stores only windows inside the time the node held the job.
        ran_from = now - timedelta(days=1)
        Allocation.objects.filter(job_id__in=ids).update(created_at=ran_from)
        Job.objects.filter(pk__in=ids).update(started_at=ran_from)
    return ids
