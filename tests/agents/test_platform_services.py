"""Platform-side services for what agents report (no processes: the services and tasks called directly)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from accounts.models import AuditLog
from agents import services
from agents.models import Gpu, GpuOutage, Node
from agents.tasks import gpu_health_task

REGISTRATION = {
    "agent_version": "0.1.0",
    "backend": "nvml",
    "gpus": [{"index": 0, "uuid": "GPU-x0", "model": "H100-80GB", "memory_mb": 81559, "isolation": "mps"}],
    "running": [],
}


def _node(db) -> tuple[Node, str]:
    token = services.node_credential_issue(name="ga-svc")
    node = services.node_authenticate(name="ga-svc", token=token)
    services.node_register(node=node, info=REGISTRATION)
    return Node.objects.get(pk=node.pk), token


def test_a_health_report_with_a_wrong_token_is_dropped(db):
    node, _ = _node(db)
    gpu_health_task(node="ga-svc", token="gpn_wrong", uuid="GPU-x0", event={"kind": "xid", "xid": 79})
    assert Gpu.objects.get(uuid="GPU-x0").health == Gpu.Health.OK
    assert not GpuOutage.objects.exists()


def test_a_health_report_for_another_nodes_gpu_is_ignored(db):
    node, token = _node(db)
    other = Node.objects.create(name="ga-other", token_hash="x", state=Node.State.UP)
    Gpu.objects.create(node=other, uuid="GPU-other", index=0, model="H100-80GB", memory_mb=81559)
    gpu_health_task(node="ga-svc", token=token, uuid="GPU-other", event={"kind": "xid", "xid": 79})
    assert Gpu.objects.get(uuid="GPU-other").health == Gpu.Health.OK


def test_repeated_hardware_events_open_one_outage(db):
    node, token = _node(db)
    for xid in (79, 79, 48):
        gpu_health_task(node="ga-svc", token=token, uuid="GPU-x0", event={"kind": "xid", "xid": xid})
    gpu = Gpu.objects.get(uuid="GPU-x0")
    assert gpu.health == Gpu.Health.OUT_OF_SERVICE and "XID 48" in gpu.health_reason
    assert GpuOutage.objects.filter(gpu=gpu, ended_at__isnull=True).count() == 1
    assert AuditLog.objects.filter(action="gpu.out_of_service", tenant=None).count() == 3


def test_registration_closes_node_down_outages_but_not_health_ones(db):
    node, token = _node(db)
    gpu = Gpu.objects.get(uuid="GPU-x0")
    now = timezone.now()
    GpuOutage.objects.create(gpu=gpu, cause=GpuOutage.Cause.NODE_DOWN, reason="down", started_at=now)
    GpuOutage.objects.create(gpu=gpu, cause=GpuOutage.Cause.HEALTH, reason="XID 79", started_at=now)
    Node.objects.filter(pk=node.pk).update(state=Node.State.DOWN)
    services.node_register(node=node, info=REGISTRATION)
    assert Node.objects.get(pk=node.pk).state == Node.State.UP
    assert GpuOutage.objects.get(cause="node_down").ended_at is not None
    assert GpuOutage.objects.get(cause="health").ended_at is None  # only the operator ends that one


def test_a_cordoned_node_stays_cordoned_when_its_agent_registers_again(db):
    node, _ = _node(db)
    services.node_cordon(node=node, reason="maintenance")
    services.node_register(node=node, info=REGISTRATION)
    node.refresh_from_db()
    assert node.state == Node.State.CORDONED and node.state_reason == "maintenance"


def test_a_cordoned_node_that_went_down_is_cordoned_again_when_it_registers(db, settings):
    node, _ = _node(db)
    services.node_cordon(node=node, reason="maintenance")
    settings.GPUSHARE = {**settings.GPUSHARE, "HEARTBEAT_INTERVAL_S": 1, "MISSED_HEARTBEATS_DOWN": 1}
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=5))
    assert services.node_down_check() == ["ga-svc"]
    assert Node.objects.get(pk=node.pk).state == Node.State.DOWN
    services.node_register(node=node, info=REGISTRATION)
    assert Node.objects.get(pk=node.pk).state == Node.State.CORDONED  # the operator's cordon holds
    services.node_uncordon(node=Node.objects.get(pk=node.pk))
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=5))
    services.node_down_check()
    services.node_register(node=node, info=REGISTRATION)
    assert Node.objects.get(pk=node.pk).state == Node.State.UP


def test_a_registration_written_before_a_job_was_placed_does_not_make_it_lost(db, rules, tenant):
    """Two registrations of a restarted agent can cross a pass: the one written before the job was placed
    there, handled after, must not call the job lost (found in CI: the job ran as attempt 3, not 2).
    One written after the placement that does not list the job does."""
    from django_scopes import scopes_disabled

    from scheduler.models import Job, JobState
    from scheduler.services import JobSpec, job_submit, schedule_pass

    node, _ = _node(db)
    job = job_submit(tenant=tenant, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["true"]))
    schedule_pass()
    with scopes_disabled():
        placed = Job.objects.get(pk=job.pk)
    assert placed.state == JobState.SCHEDULED and placed.node_id == node.pk
    placed_ms = int(placed.scheduled_at.timestamp() * 1000)

    services.node_register(node=node, info={**REGISTRATION, "at_ms": placed_ms - 500})
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).state == JobState.SCHEDULED and Job.objects.get(pk=job.pk).attempt == 1

    services.node_register(node=node, info={**REGISTRATION, "at_ms": placed_ms + 500})
    with scopes_disabled():
        after = Job.objects.get(pk=job.pk)
    assert after.state == JobState.QUEUED  # lost, then requeued (LOST_JOB_POLICY=requeue)
