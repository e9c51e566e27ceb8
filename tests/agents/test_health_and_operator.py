"""GPU health events end to end (fake NVML -> agent -> platform) and the
operator's node commands."""

from __future__ import annotations

import sys

import pytest
from django.core.management import CommandError, call_command
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents.models import Gpu, GpuOutage, Node
from agents.services import node_drains_settle
from scheduler.models import Job, JobState
from scheduler.services import job_cancel
from tests.agents.conftest import GPU0, GPU1
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

RUN = "import time; print('up', flush=True); time.sleep({seconds})"


def _submit(platform, session, seconds: float = 60, gpus=1, kind="training") -> int:
    body = {"kind": kind, "gpus": gpus, "command": [sys.executable, "-c", RUN.format(seconds=seconds)]}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _job(job_id: int) -> Job:
    with scopes_disabled():
        return Job.objects.get(pk=job_id)


def _running_on(job_id: int) -> str:
    wait_for(lambda: _job(job_id).state == JobState.RUNNING, timeout=45, what=f"job {job_id} to run")
    with scopes_disabled():
        return Job.objects.get(pk=job_id).allocations.values_list("gpu__uuid", flat=True).get()


def _ended(job_id: int) -> Job:
    return wait_for(
        lambda: (j := _job(job_id)).state in (JobState.FAILED, JobState.SUCCEEDED, JobState.CANCELLED) and j,
        timeout=45,
        what=f"job {job_id} to end",
    )


def test_application_xid_fails_the_job_and_keeps_the_gpu(platform, nvml_agent, fake_nvml):
    nvml_agent()
    session = platform.session_for(TenantFactory(slug="acme"))
    job_id = _submit(platform, session)
    uuid = _running_on(job_id)
    fake_nvml.xid([GPU0, GPU1].index(uuid), 13)
    job = _ended(job_id)
    assert job.state == JobState.FAILED
    assert f"XID 13 (application error) on GPU {uuid}" in job.stop_reason
    wait_for(
        lambda: AuditLog.objects.filter(action="gpu.application_error", target__endswith=uuid).exists(),
        what="the audit entry",
    )
    gpu = Gpu.objects.get(uuid=uuid)
    assert gpu.health == Gpu.Health.OK
    assert not GpuOutage.objects.filter(gpu=gpu).exists()


def test_hardware_xid_takes_the_gpu_out_until_the_operator_returns_it(platform, nvml_agent, fake_nvml):
    nvml_agent()
    session = platform.session_for(TenantFactory(slug="acme"))
    job_id = _submit(platform, session)
    uuid = _running_on(job_id)
    fake_nvml.xid([GPU0, GPU1].index(uuid), 79)
    assert _ended(job_id).state == JobState.FAILED
    wait_for(lambda: Gpu.objects.get(uuid=uuid).health == Gpu.Health.OUT_OF_SERVICE, what="the GPU out of service")
    gpu = Gpu.objects.get(uuid=uuid)
    assert "XID 79" in gpu.health_reason
    outage = GpuOutage.objects.get(gpu=gpu)
    assert outage.cause == "health" and outage.ended_at is None
    assert AuditLog.objects.filter(action="gpu.out_of_service", tenant=None, target__endswith=uuid).exists()

    # Two new jobs: only one GPU is in service, so one runs and one waits.
    first, second = _submit(platform, session), _submit(platform, session)
    assert _running_on(first) != uuid
    wait_for(lambda: _job(second).pending_reason, what="the second job's pending reason")
    assert _job(second).state == JobState.QUEUED

    call_command("node", "return-gpu", uuid, reason="reseated")
    gpu.refresh_from_db()
    assert gpu.health == Gpu.Health.OK
    assert GpuOutage.objects.get(gpu=gpu).ended_at is not None
    assert _running_on(second) == uuid


def test_cordon_and_drain_take_effect(platform, agent_factory, node):
    agent_factory(node, gpus="sim:2xH100-80GB")
    session = platform.session_for(TenantFactory(slug="acme"))
    call_command("node", "cordon", node)
    assert Node.objects.get(name=node).state == Node.State.CORDONED
    queued = _submit(platform, session, seconds=60)
    wait_for(lambda: _job(queued).pending_reason, what="a pending reason")
    assert _job(queued).state == JobState.QUEUED

    call_command("node", "uncordon", node)
    _running_on(queued)

    short = _submit(platform, session, seconds=4)
    _running_on(short)
    call_command("node", "drain", node)
    assert Node.objects.get(name=node).state == Node.State.DRAINING
    waiting = _submit(platform, session, seconds=1)
    wait_for(lambda: _job(waiting).pending_reason, what="a pending reason")
    assert _job(waiting).state == JobState.QUEUED
    assert node_drains_settle() == []  # jobs still run there
    _ended(short)
    assert node_drains_settle() == []
    job_cancel(job=_job(queued), reason="operator wants the node empty")  # the agent stops it for real
    assert _ended(queued).state == JobState.CANCELLED
    assert node_drains_settle() == [node]
    assert Node.objects.get(name=node).state == Node.State.CORDONED
    actions = list(AuditLog.objects.filter(target=node).order_by("id").values_list("action", flat=True))
    assert actions == ["node.cordon", "node.uncordon", "node.drain", "node.drained"]


def test_node_commands_refuse_what_the_state_does_not_allow(db):
    Node.objects.create(name="ga-down", state=Node.State.DOWN, token_hash="x")
    with pytest.raises(CommandError, match="only an up or draining node can be cordoned"):
        call_command("node", "cordon", "ga-down")
    with pytest.raises(CommandError, match="only an up node can be drained"):
        call_command("node", "drain", "ga-down")
    with pytest.raises(CommandError, match="no node named 'nope'"):
        call_command("node", "cordon", "nope")


@pytest.mark.parametrize(("xid", "action"), [(79, "gpu.out_of_service"), (13, "gpu.application_error")])
def test_a_resent_health_report_is_acted_on_once(db, xid, action):
    """The agent re-sends a report whose acknowledgement was lost: one audit row, and a GPU the
    operator returned to service in between stays in service."""
    from agents.services import gpu_health_record, gpu_return_to_service

    node = Node.objects.create(name="n-health")
    gpu = Gpu.objects.create(node=node, index=0, uuid="GPU-resent-0001", model="H100", memory_mb=81920)
    event = {"kind": "xid", "xid": xid}
    gpu_health_record(node=node, uuid=gpu.uuid, event=event, at_ms=1_700_000_000_000)
    if action == "gpu.out_of_service":
        gpu_return_to_service(gpu=gpu, note="reseated")
    gpu_health_record(node=node, uuid=gpu.uuid, event=event, at_ms=1_700_000_000_000)
    assert AuditLog.objects.filter(action=action, target=f"n-health/{gpu.uuid}").count() == 1
    gpu.refresh_from_db()
    assert gpu.health == Gpu.Health.OK
    # A new event (another instant) is acted on.
    gpu_health_record(node=node, uuid=gpu.uuid, event=event, at_ms=1_700_000_060_000)
    assert AuditLog.objects.filter(action=action, target=f"n-health/{gpu.uuid}").count() == 2
