"""Fleet builders for scheduler tests on the database (no agent processes)."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from scheduler.services import JobSpec, job_submit

MEMORY = {"H100-80GB": 81920, "L4-24GB": 24576}


def node_add(name: str, count: int = 8, model: str = "H100-80GB", **gpu_fields) -> Node:
    node = Node.objects.create(name=name, state=Node.State.UP, token_hash="x")
    Gpu.objects.bulk_create(
        Gpu(node=node, uuid=f"GPU-{name}-{i}", index=i, model=model, memory_mb=MEMORY.get(model, 16384), **gpu_fields)
        for i in range(count)
    )
    return node


def submit(tenant, *, gpus=1, kind=None, priority="", max_runtime_s=None, **spec):
    milli = int(round(gpus * 1000))
    kind = kind or ("training" if milli % 1000 == 0 else "inference")
    job = job_submit(
        tenant=tenant,
        user=None,
        spec=JobSpec(
            kind=kind, gpu_milli=milli, command=["true"], priority=priority, max_runtime_s=max_runtime_s, **spec
        ),
    )
    return job


def reload(job):
    with scopes_disabled():
        job.refresh_from_db()
    return job


@pytest.fixture
def sched(db, rules, tenant, other_tenant):
    """Rules seeded; returns nothing, tests build nodes with ``node_add``."""
    return None
