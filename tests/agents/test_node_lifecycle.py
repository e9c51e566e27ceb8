"""kill -9 of the agent mid-job, the platform's reaction, and the agent's
reconciliation when it comes back."""

from __future__ import annotations

import sys
import time

import psutil
import pytest
from django_scopes import scopes_disabled

from agents import services
from agents.models import GpuOutage, Node
from billing.models import UsageWindow
from scheduler.models import Job, JobEvent, JobState
from tests.agents.conftest import wait_output
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

PRINT_PID_AND_RUN = "import os, time; print('PID=%d' % os.getpid(), flush=True); time.sleep(120)"


@pytest.fixture
def fast_heartbeats(settings):
    settings.GPUSHARE = {**settings.GPUSHARE, "HEARTBEAT_INTERVAL_S": 1, "MISSED_HEARTBEATS_DOWN": 3}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _job(job_id: int) -> Job:
    with scopes_disabled():
        return Job.objects.select_related("node").get(pk=job_id)


def _start_job(platform, agent) -> tuple[int, int]:
    session = platform.session_for(TenantFactory(slug="acme"))
    body = {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", PRINT_PID_AND_RUN]}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    pid = int(wait_output(agent, job_id, "PID=").split("PID=")[1].split()[0])
    wait_for(lambda: _job(job_id).state == JobState.RUNNING, timeout=30, what="the job to run")
    return job_id, pid


def test_kill_9_of_the_agent_marks_the_node_down_and_restart_reconciles(platform, agent_factory, fast_heartbeats, node):
    agent = agent_factory(node, gpus="sim:2xH100-80GB")
    job_id, pid = _start_job(platform, agent)
    with scopes_disabled():
        wait_for(lambda: UsageWindow.objects.filter(job_id=job_id).exists(), timeout=30, what="a first window")

    agent.kill()
    killed_ms = time.time_ns() // 1_000_000
    assert _alive(pid), "the job outlives its agent (own session)"
    downed = wait_for(lambda: services.node_down_check(), timeout=30, what="the node to be marked down")
    assert downed == [node]

    down = Node.objects.get(name=node)
    assert down.state == Node.State.DOWN and "missed 3 heartbeats" in down.state_reason
    job = _job(job_id)
    assert job.state == JobState.QUEUED  # LOST_JOB_POLICY=requeue
    with scopes_disabled():
        assert list(JobEvent.objects.filter(job_id=job_id).values_list("to_state", flat=True))[-2:] == [
            JobState.LOST,
            JobState.QUEUED,
        ]
        assert not job.allocations.filter(released_at__isnull=True).exists()  # its GPU is free
        last_end = max(UsageWindow.objects.filter(job_id=job_id).values_list("end_ms", flat=True))
    assert last_end <= killed_ms  # billing stopped at the last window the agent sent
    outages = GpuOutage.objects.filter(gpu__node=down)
    assert outages.count() == 2 and all(o.cause == "node_down" and o.ended_at is None for o in outages)

    # The agent comes back: it kills what its previous run left, registers, the node is up again.
    agent.start()
    wait_for(lambda: not _alive(pid), timeout=45, what="the leftover job process to be killed")
    wait_for(lambda: Node.objects.get(name=node).state == Node.State.UP, timeout=45, what="the node up")
    assert "killed leftover job" in agent.log()
    assert all(o.ended_at is not None for o in GpuOutage.objects.filter(gpu__node=down))
    # The requeued job runs again there, as attempt 2.
    wait_for(
        lambda: (j := _job(job_id)).state == JobState.RUNNING and j.attempt == 2, timeout=60, what="attempt 2 to run"
    )


def test_a_quick_restart_reports_what_runs_and_the_platform_reconciles(platform, agent_factory, node):
    agent = agent_factory(node, gpus="sim:1xH100-80GB")
    job_id, pid = _start_job(platform, agent)
    agent.kill()
    agent.start()  # before anyone noticed: the node never went down
    wait_for(lambda: not _alive(pid), timeout=45, what="the leftover process to be killed")
    # Registration says nothing runs: the platform marks attempt 1 lost and requeues it; it runs again.
    wait_for(
        lambda: (j := _job(job_id)).attempt == 2 and j.state == JobState.RUNNING,
        timeout=60,
        what="the job requeued and running again",
    )
    with scopes_disabled():
        states = list(JobEvent.objects.filter(job_id=job_id).values_list("to_state", flat=True))
    assert JobState.LOST in states
    assert Node.objects.get(name=node).state == Node.State.UP


def test_a_node_marked_down_while_its_agent_still_runs_comes_back(platform, agent_factory, node):
    """No outage seen by the agent (it was late, not gone): the platform asks it to register again."""
    agent_factory(node, gpus="sim:1xH100-80GB")
    Node.objects.filter(name=node).update(state=Node.State.DOWN, state_reason="missed 3 heartbeats")
    wait_for(lambda: Node.objects.get(name=node).state == Node.State.UP, timeout=45, what="the node to come back")
    assert Node.objects.get(name=node).state_reason == ""
