"""Ingest believes only what can be true (PostgreSQL, the real services).

A window is stored only inside its attempt's run on the node that held the
job; the job's billed GPU time never exceeds the time its GPUs were held;
refused windows are kept in quarantine with the reason. A GPU UUID belongs to
the node that registered it first.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents import services
from agents.models import Gpu, LinkRefusal, QuarantinedWindow
from billing.models import UsageWindow
from billing.services import usage_windows_ingest
from scheduler.models import Job
from tests.billing.conftest import window

pytestmark = pytest.mark.django_db

MIN = 60_000


def _ms(value) -> int:
    return int(value.timestamp() * 1000)


def cost(job) -> Decimal:
    with scopes_disabled():
        return Job.objects.get(pk=job.pk).cost


def finished_job(fleet, tenant, node, *, ran_for=timedelta(minutes=1), ago=timedelta(days=3)):
    """A job that ran on ``node`` for ``ran_for``, ``ago`` (and its window, stored)."""
    start = timezone.now() - ago
    job = fleet.job(tenant, node=node, at=start, released=start + ran_for)
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(state="succeeded", started_at=start, finished_at=start + ran_for)
        job.refresh_from_db()
    stored = usage_windows_ingest(node=node, windows=[window(job, 0, _ms(start), _ms(start + ran_for))])
    assert stored["stored"] == 1
    return job, _ms(start), _ms(start + ran_for)


def test_forged_future_windows_for_a_finished_job_are_quarantined_not_billed(fleet, tenant, other_tenant):
    node = fleet.node()
    job, _, _ = finished_job(fleet, other_tenant, node)
    before = cost(job)
    future = _ms(timezone.now() + timedelta(days=2))
    forged = [window(job, 1 + i, future + i * 15 * MIN, future + (i + 1) * 15 * MIN) for i in range(96)]

    result = usage_windows_ingest(node=node, windows=forged)

    assert result == {"stored": 0, "rejected": 96, "replayed": 0}
    assert cost(job) == before
    with scopes_disabled():
        assert UsageWindow.objects.filter(job=job).count() == 1
    kept = QuarantinedWindow.objects.filter(node=node, job_id=job.pk)
    assert kept.count() == 96
    assert all("future" in reason for reason in kept.values_list("reason", flat=True))


def test_a_window_after_the_attempt_finished_is_refused(fleet, tenant):
    node = fleet.node()
    job, _, end = finished_job(fleet, tenant, node)
    result = usage_windows_ingest(node=node, windows=[window(job, 1, end + 60 * MIN, end + 75 * MIN)])
    assert result["rejected"] == 1
    reason = QuarantinedWindow.objects.get(job_id=job.pk).reason
    assert "outside the times node" in reason or "finished" in reason


def test_a_window_before_the_attempt_started_is_refused(fleet, tenant):
    node = fleet.node()
    placed = timezone.now() - timedelta(hours=2)
    job = fleet.job(tenant, node=node, at=placed)  # placed 2 h ago, running
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(started_at=placed + timedelta(hours=1))
        job.refresh_from_db()
    early = _ms(placed + timedelta(minutes=10))

    result = usage_windows_ingest(node=node, windows=[window(job, 0, early, early + 10 * MIN)])

    assert result["rejected"] == 1
    assert "before attempt 1" in QuarantinedWindow.objects.get(job_id=job.pk).reason
    assert cost(job) == 0


def test_a_window_inside_the_run_within_clock_skew_is_stored(fleet, tenant):
    node = fleet.node()
    job, start, end = finished_job(fleet, tenant, node, ran_for=timedelta(minutes=2))
    # the agent's clock ran 5 s ahead: the last window ends a little after the finish the platform saw
    result = usage_windows_ingest(node=node, windows=[window(job, 1, end, end + 5_000)])
    assert result["stored"] == 1


def test_another_nodes_job_is_refused_and_quarantined(fleet, tenant):
    node, intruder = fleet.node("node-a"), fleet.node("node-b")
    job, start, end = finished_job(fleet, tenant, node)
    result = usage_windows_ingest(node=intruder, windows=[window(job, 5, start, end)])
    assert result["rejected"] == 1
    assert QuarantinedWindow.objects.get(node=intruder).reason == f"job {job.pk} was never placed on node node-b"


def test_billed_gpu_time_never_exceeds_the_time_the_gpus_were_held(fleet, tenant):
    node = fleet.node()
    start = timezone.now() - timedelta(hours=1)
    # two GPUs asked for, one allocation held: the GPUs were held for 1 × wall time at most
    job = fleet.job(
        tenant, node=node, gpu_milli=2000, gpu_indexes=[0], at=start, released=start + timedelta(minutes=10)
    )
    result = usage_windows_ingest(node=node, windows=[window(job, 0, _ms(start), _ms(start) + 10 * MIN)])
    assert result["rejected"] == 1
    assert "exceed the time its GPUs were held" in QuarantinedWindow.objects.get(job_id=job.pk).reason


def test_a_resent_refused_window_is_quarantined_once(fleet, tenant):
    node = fleet.node()
    job, _, end = finished_job(fleet, tenant, node)
    bad = window(job, 1, end + 60 * MIN, end + 61 * MIN)
    usage_windows_ingest(node=node, windows=[bad])
    usage_windows_ingest(node=node, windows=[bad])
    assert QuarantinedWindow.objects.filter(job_id=job.pk).count() == 1


# --- GPU ownership ---------------------------------------------------------------


def _info(*uuids) -> dict:
    gpus = [{"uuid": u, "index": i, "model": "H100-80GB", "memory_mb": 81559} for i, u in enumerate(uuids)]
    return {"agent_version": "t", "backend": "sim", "gpus": gpus, "running": []}


def test_a_second_node_cannot_take_over_a_registered_gpu(db, caplog):
    services.node_credential_issue(name="gpu-owner")
    services.node_credential_issue(name="gpu-thief")
    from agents.models import Node

    first, second = Node.objects.get(name="gpu-owner"), Node.objects.get(name="gpu-thief")
    services.node_register(node=first, info=_info("GPU-victim-0", "GPU-victim-1"))

    with caplog.at_level(logging.ERROR, logger="agents.services"):
        services.node_register(node=second, info=_info("GPU-victim-0", "GPU-thief-own"))

    assert Gpu.objects.get(uuid="GPU-victim-0").node == first
    assert Gpu.objects.get(uuid="GPU-thief-own").node == second
    assert LinkRefusal.objects.filter(node=second, direction="gpu_claim").count() == 1
    assert AuditLog.objects.filter(action="gpu.claim_refused").exists()
    assert any("OPERATOR" in r.message and "GPU-victim-0" in r.message for r in caplog.records)
    # only the operator moves it
    services.gpu_move(gpu=Gpu.objects.get(uuid="GPU-victim-0"), to=second)
    assert Gpu.objects.get(uuid="GPU-victim-0").node == second
