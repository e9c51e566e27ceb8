"""Builders for billing tests: nodes, GPUs, jobs placed on them, windows."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from billing.models import Price
from scheduler.models import Allocation, Job, PriorityClass


def ms(*args) -> int:
    """ms(2026, 3, 31, 23, 59) -> epoch milliseconds (UTC)."""
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


def dt(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


class Fleet:
    def __init__(self):
        self.nodes: dict[str, Node] = {}

    def node(self, name: str = "node-a", *, gpus=("H100-80GB", "H100-80GB", "L4-24GB", "L4-24GB")) -> Node:
        node = Node.objects.create(name=name, state=Node.State.UP, token_hash="x", registered_at=dt(2026, 1, 1))
        for i, model in enumerate(gpus):
            Gpu.objects.create(node=node, uuid=f"{name}-gpu-{i}", index=i, model=model, memory_mb=80000)
        self.nodes[name] = node
        return node

    @scopes_disabled()
    def job(
        self,
        tenant,
        *,
        node: Node,
        model: str = "H100-80GB",
        gpu_milli: int = 1000,
        priority: str = "standard",
        gpu_indexes=None,
        at=None,
        released=None,
    ) -> Job:
        mode = "dedicated" if gpu_milli % 1000 == 0 else "shared"
        job = Job.objects.create(
            tenant=tenant,
            kind="training" if mode == "dedicated" else "inference",
            mode=mode,
            gpu_milli=gpu_milli,
            command=["true"],
            priority=PriorityClass.objects.get(name=priority),
            max_runtime_s=3600,
            gpu_model=model,
            state="running",
            node=node,
            attempt=1,
        )
        gpus = list(node.gpus.filter(model=model).order_by("index"))
        if gpu_indexes is not None:
            gpus = [g for g in node.gpus.order_by("index") if g.index in gpu_indexes]
        count = max(1, gpu_milli // 1000)
        share = min(1000, gpu_milli)
        # Ingest stores only windows inside the time the node held the job: by default the job was
        # placed on 2026-01-01 and still runs (the tests' windows are in 2026).
        at = at if at is not None else dt(2026, 1, 1)
        for gpu in gpus[:count]:
            a = Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=share)
            Allocation.objects.filter(pk=a.pk).update(created_at=at, released_at=released)
        return job


def window(job, seq, start_ms, end_ms, *, attempt=1, **extra) -> dict:
    return {"job_id": job.pk, "attempt": attempt, "seq": seq, "start_ms": start_ms, "end_ms": end_ms, **extra}


def price_set(model: str, mode: str, per_hour: str, since: datetime) -> Price:
    return Price.objects.create(gpu_model=model, mode=mode, per_gpu_hour=Decimal(per_hour), effective_from=since)


@pytest.fixture
def fleet(rules):
    return Fleet()
