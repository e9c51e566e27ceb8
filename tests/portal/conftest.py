"""Fixtures for the portal's page tests: logged-in browsers (Django's test
client) per role, and jobs, GPUs and metered usage to show."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Role
from agents.models import Gpu, Node
from billing.models import UsageWindow
from scheduler import services
from scheduler.models import Allocation, Job, JobEvent, JobState
from tests.factories import member_add


@pytest.fixture
def client_for(rules):
    """``client_for(tenant, role=...)`` -> a Client logged in as a new member with that role (``.user`` set)."""

    def make(tenant, *, role: str = Role.OWNER, user=None) -> Client:
        user = member_add(tenant, role=role, user=user)
        client = Client()
        client.force_login(user)
        client.user = user
        return client

    return make


def job_make(tenant, *, user=None, name: str = "job", gpus: int = 1000, kind: str = "training", **spec) -> Job:
    """A queued job, submitted through the scheduler's service."""
    job = services.job_submit(
        tenant=tenant,
        user=user,
        spec=services.JobSpec(kind=kind, gpu_milli=gpus, command=["python", "train.py"], name=name, **spec),
    )
    with scopes_disabled():
        return Job.objects.get(pk=job.pk)


@pytest.fixture
def node(db):
    node = Node.objects.create(name="node-p", state=Node.State.UP, token_hash="x", backend="sim")
    for index, model in enumerate(["H100-80GB", "L4-24GB"]):
        Gpu.objects.create(node=node, uuid=f"GPU-portal-{index}", index=index, model=model, memory_mb=81920)
    return node


def job_ran(job: Job, node: Node, *, windows: int = 3, window_ms: int = 1000, amount: str = "0.0007") -> Job:
    """Put ``job`` on ``node``'s first GPU as if it ran and was metered (rows written directly)."""
    from decimal import Decimal

    gpu = node.gpus.order_by("index").first()
    start = int(timezone.now().timestamp() * 1000) - windows * window_ms
    with scopes_disabled():
        Allocation.objects.create(
            tenant_id=job.tenant_id, job=job, gpu=gpu, share_milli=1000, released_at=timezone.now()
        )
        for seq in range(windows):
            UsageWindow.objects.create(
                tenant_id=job.tenant_id,
                job=job,
                node=node,
                seq=seq,
                start_ms=start + seq * window_ms,
                end_ms=start + (seq + 1) * window_ms,
                gpu_model=gpu.model,
                mode=job.mode,
                gpu_ms=window_ms,
                sm_util_ms=window_ms * (50 + seq * 10) // 100,
                memory_avg_mb=1000 + seq,
                memory_peak_mb=2000,
                energy_mj=window_ms * 300,
                amount=Decimal(amount),
            )
        Job.objects.filter(pk=job.pk).update(
            node=node,
            state=JobState.SUCCEEDED,
            isolation="exclusive",
            exit_code=0,
            started_at=timezone.now(),
            finished_at=timezone.now(),
            cost=Decimal(amount) * windows,
            gpu_ms=window_ms * windows,
        )
        JobEvent.objects.create(tenant_id=job.tenant_id, job=job, from_state="queued", to_state="succeeded")
        return Job.objects.get(pk=job.pk)
