"""Broker outages and agent crashes.

The outage cuts a TCP proxy between the agent and Redis (the shared Redis
server keeps running for everyone else): the job keeps running, its windows go
to the agent's SQLite outbox and, once the link is back, arrive exactly once.
"""

from __future__ import annotations

import sqlite3
import sys
from urllib.parse import urlparse

import pytest
from django.conf import settings
from django_scopes import scopes_disabled

from billing.models import UsageWindow
from chaos.proxy import CuttableProxy
from scheduler.models import Job, JobState
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_proxy():
    target = urlparse(settings.REDIS_URL)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379)
    yield proxy
    proxy.close()


def _redis_db() -> int:
    return int(urlparse(settings.REDIS_URL).path.strip("/") or 0)


def _outbox(agent) -> int:
    db = sqlite3.connect(agent.var_dir / "agent" / agent.node / "state.sqlite3")
    try:
        return db.execute("SELECT COUNT(*) FROM outbox WHERE task = 'agents.usage'").fetchone()[0]
    finally:
        db.close()


def _submit(platform, session, seconds: float) -> int:
    body = {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", f"import time; time.sleep({seconds})"]}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _windows(job_id: int) -> list[UsageWindow]:
    with scopes_disabled():
        return list(UsageWindow.objects.filter(job_id=job_id).order_by("attempt", "seq"))


def _beat() -> None:
    """What celery beat does every few seconds in production (tests run no beat): a scheduling pass.
    A pass skips a job whose row another transaction holds (here: the replayed windows' ingest)."""
    from scheduler.services import schedule_pass

    schedule_pass()


def _job(job_id: int) -> Job:
    with scopes_disabled():
        return Job.objects.get(pk=job_id)


def test_windows_spool_during_an_outage_and_arrive_exactly_once(
    platform, agent_factory, redis_proxy, node, celery_worker_process
):
    agent = agent_factory(node, extra=["--broker", redis_proxy.url(_redis_db())])
    session = platform.session_for(TenantFactory(slug="acme"))
    job_id = _submit(platform, session, 14)
    wait_for(lambda: len(_windows(job_id)) >= 2, timeout=45, what="the first windows")

    redis_proxy.cut()
    wait_for(lambda: _outbox(agent) >= 3, timeout=30, what="windows to pile up in the outbox")
    stored_during = len(_windows(job_id))
    assert _job(job_id).state == JobState.RUNNING
    assert "spooling locally" in agent.log() or "could not deliver" in agent.log()

    redis_proxy.restore()
    job = wait_for(
        lambda: (j := _job(job_id)).state in (JobState.SUCCEEDED, JobState.FAILED) and j,
        timeout=60,
        what="the job to end after the outage",
    )
    assert job.state == JobState.SUCCEEDED
    wait_for(lambda: _outbox(agent) == 0, timeout=30, what="the outbox to drain")
    windows = _windows(job_id)
    assert len(windows) > stored_during
    assert [w.seq for w in windows] == list(range(len(windows))), (  # none lost, none twice
        agent.log()[-3000:] + celery_worker_process.log_path.read_text()[-6000:]
    )
    assert all(a.end_ms == b.start_ms for a, b in zip(windows, windows[1:], strict=False))
    held_ms = sum(w.end_ms - w.start_ms for w in windows)
    assert held_ms == round((job.finished_at - job.started_at).total_seconds() * 1000)
    assert held_ms >= 14_000
    assert job.gpu_ms == held_ms


def test_an_outage_long_enough_to_down_the_node_ends_with_one_copy_of_the_job(
    platform, agent_factory, redis_proxy, node, settings
):
    """The platform gave up on the node and requeued its job; when the link returns the agent registers
    again, the platform reconciles, and the old copy is stopped: the job never runs twice."""
    from agents import services
    from agents.models import Node

    settings.GPUSHARE = {**settings.GPUSHARE, "HEARTBEAT_INTERVAL_S": 1, "MISSED_HEARTBEATS_DOWN": 3}
    agent = agent_factory(node, gpus="sim:1xH100-80GB", extra=["--broker", redis_proxy.url(_redis_db())])
    session = platform.session_for(TenantFactory(slug="acme"))
    job_id = _submit(platform, session, 120)
    wait_for(lambda: _job(job_id).state == JobState.RUNNING, timeout=45, what="the job to run")

    redis_proxy.cut()
    assert wait_for(lambda: services.node_down_check(), timeout=30, what="the node marked down") == [node]
    assert _job(job_id).state == JobState.QUEUED  # lost, requeued; nowhere to run meanwhile
    redis_proxy.restore()

    wait_for(lambda: Node.objects.get(name=node).state == Node.State.UP, timeout=45, what="the node back up")
    # Attempt 1 (still running through the outage) is stopped; the requeued job runs as attempt 2.
    wait_for(lambda: "job " + str(job_id) + " attempt 1 ended" in agent.log(), timeout=45, what="attempt 1 stopped")
    job = wait_for(
        lambda: _beat() or ((j := _job(job_id)).state == JobState.RUNNING and j.attempt == 2 and j),
        timeout=60,
        interval=1,
        what="attempt 2 running",
    )
    assert job.node.name == node
    assert agent.log().count(f"job {job_id} attempt 2 started") == 1


def test_a_broker_lost_while_acknowledging_a_command_is_an_outage_not_the_agents_end(redis_proxy, tmp_path):
    """The CI failure of session 17: the link dropped between receiving a command and acknowledging it, and
    the acknowledgement's exception ended the agent's process (no windows spooled, no reconnect). Real
    Redis behind the cuttable proxy, the agent's own link and outbox."""
    from kombu import Connection

    from agents.agent.brokerconf import broker_options, node_queue
    from agents.agent.config import AgentConfig
    from agents.agent.gpus import SimBackend
    from agents.agent.main import Agent
    from agents.agent.spool import Spool
    from agents.agent.transport import BrokerLink

    node = f"ack-cut-{tmp_path.name[-12:]}"
    url, options = broker_options(redis_proxy.url(_redis_db()), tmp_path, node=node)
    link = BrokerLink(url=url, transport_options=options, node_name=node)
    config = AgentConfig(node=node, token="gpn_test", broker_url=url, var_dir=tmp_path)
    agent = Agent(config, SimBackend("sim:1xH100-80GB", node), link, Spool(tmp_path / "state.sqlite3"))
    link.connect()
    with Connection(settings.REDIS_URL) as direct, direct.SimpleQueue(node_queue(node)) as commands:
        commands.put([[], {"unsigned": True}, {}], headers={"task": "agent.stop"})
    try:
        command = link.receive(timeout=5)
        assert command is not None
        redis_proxy.cut()
        agent.handle(command)  # refused (no platform key here), reported, then acknowledged: the link is gone
        assert not link.connected
        assert agent.commands_refused == 1
        assert agent.spool.pending() == 1  # the refusal's report waits in the outbox for the reconnect
        agent.commands_receive(timeout=0.1)  # offline now: nothing to receive, nothing raised
        redis_proxy.restore()
        assert agent.ensure_connected()
    finally:
        link.disconnect()
        with Connection(settings.REDIS_URL) as direct:
            direct.default_channel.client.delete(node_queue(node))
