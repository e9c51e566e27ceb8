"""Reports over the real broker to the real worker: attributed by credential, acknowledged, never a platform task."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone
from django_scopes import scopes_disabled

from agents import nodelink
from agents.agent import protocol as p
from agents.agent.brokerconf import broker_options, node_queue
from agents.agent.protocol import ACK, R_USAGE, REPORT_QUEUE, CommandVerifier, public_key_parse, report_kwargs
from agents.agent.transport import BrokerLink
from agents.models import LinkRefusal, QuarantinedWindow
from agents.services import node_credential_issue
from scheduler.models import Job
from tests.billing.conftest import window
from tests.factories import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def link_for(node: str) -> BrokerLink:
    url, options = broker_options(settings.REDIS_URL, settings.VAR_DIR, node=node)
    link = BrokerLink(url=url, transport_options=options, node_name=node)
    link.connect()
    return link


def ack_received(client, node: str):
    """The next command on ``node``'s queue, its signature verified as the agent does."""
    raw = wait_for(lambda: client.rpop(node_queue(node)), what="the acknowledgement on the node's queue")
    envelope = json.loads(raw)
    body = json.loads(base64.b64decode(envelope["body"]))
    verifier = CommandVerifier(
        node, [public_key_parse(k) for k in nodelink.trusted_keys()], lambda nonce, expires: False
    )
    return verifier.verify(envelope["headers"]["task"], body[1])


def _ms(value) -> int:
    return int(value.timestamp() * 1000)


@pytest.fixture
def two_nodes(celery_worker_process, fleet, tenant):
    victim, intruder = fleet.node("rep-victim"), fleet.node("rep-intruder")
    tokens = {n.name: node_credential_issue(name=n.name) for n in (victim, intruder)}
    start = timezone.now() - timedelta(minutes=30)
    job = fleet.job(tenant, node=victim, at=start)
    return victim, intruder, tokens, job, _ms(start)


def test_a_report_naming_another_node_is_refused_and_one_without_is_attributed_to_its_sender(two_nodes):
    victim, intruder, tokens, job, start = two_nodes
    windows = [window(job, 0, start, start + 60_000)]
    link = link_for(intruder.name)
    try:
        # the intruder's credential, claiming to be the victim
        link.send(
            R_USAGE, report_kwargs(token=tokens[intruder.name], node=victim.name, seqs=[1], body={"windows": windows})
        )
        refused = wait_for(
            lambda: LinkRefusal.objects.filter(node=intruder, reason__contains="names node").first(),
            what="the forged report to be refused",
        )
        assert "sent with rep-intruder's credential" in refused.reason
        # the same windows without the claim: attributed to the intruder, who never held the job
        link.send(R_USAGE, report_kwargs(token=tokens[intruder.name], seqs=[2], body={"windows": windows}))
        kept = wait_for(lambda: QuarantinedWindow.objects.filter(node=intruder).first(), what="the quarantine")
        assert kept.reason == f"job {job.pk} was never placed on node rep-intruder"
    finally:
        link.disconnect()
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).cost == 0


def test_a_stored_report_is_acknowledged_to_its_node_by_sequence_number(two_nodes):
    victim, _, tokens, job, start = two_nodes
    client = redis.Redis.from_url(settings.REDIS_URL)
    windows = [window(job, 0, start, start + 60_000), window(job, 1, start + 60_000, start + 120_000)]
    link = link_for(victim.name)
    try:
        link.send(R_USAGE, report_kwargs(token=tokens[victim.name], seqs=[41, 42], body={"windows": windows}))
    finally:
        link.disconnect()
    ack = ack_received(client, victim.name)
    assert (ack.task, ack.body["seqs"]) == (ACK, [41, 42])
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).gpu_ms == 120_000


def test_a_platform_task_on_the_report_queue_does_not_run(celery_worker_process, db):
    from gpushare.celery import app

    # published where a node's credential can write: the report queue
    app.send_task(
        "agents.link_refusal",
        kwargs={"direction": "report", "task": "x", "reason": "RAN-FROM-REPORTS"},
        queue=REPORT_QUEUE,
    )
    app.send_task("billing.close_month", kwargs={}, queue=REPORT_QUEUE)
    refused = wait_for(
        lambda: LinkRefusal.objects.filter(reason__contains="arrived on the report queue").count() >= 2,
        what="both platform tasks to be refused",
    )
    assert refused
    assert set(
        LinkRefusal.objects.filter(reason__contains="arrived on the report queue").values_list("task", flat=True)
    ) == {"agents.link_refusal", "billing.close_month"}
    # the control: the same task where only the platform writes runs
    app.send_task(
        "agents.link_refusal",
        kwargs={"direction": "report", "task": "x", "reason": "RAN-FROM-PLATFORM"},
        queue="platform",
    )
    wait_for(lambda: LinkRefusal.objects.filter(reason="RAN-FROM-PLATFORM").exists(), what="the platform-queue task")
    assert not LinkRefusal.objects.filter(reason="RAN-FROM-REPORTS").exists()


def test_junk_on_the_report_queue_does_not_stop_the_worker(two_nodes, celery_worker_process):
    """A node can push anything onto the report queue; the worker drops what is not a message and goes on."""
    victim, _, tokens, job, start = two_nodes
    client = redis.Redis.from_url(settings.REDIS_URL)
    for junk in (b"not json", b'"a json string"', b'{"body": "x"}', b"[1, 2]"):
        client.lpush(REPORT_QUEUE, junk)
    link = link_for(victim.name)
    try:
        windows = [window(job, 0, start, start + 60_000)]
        link.send(R_USAGE, report_kwargs(token=tokens[victim.name], seqs=[1], body={"windows": windows}))
    finally:
        link.disconnect()
    with scopes_disabled():
        wait_for(lambda: Job.objects.get(pk=job.pk).gpu_ms == 60_000, what="the report after the junk to be stored")
    assert celery_worker_process.proc.poll() is None
    assert "Unrecoverable error" not in celery_worker_process.log_path.read_text(errors="replace")


def test_a_batch_of_job_events_is_acted_on_in_order_a_malformed_event_refused_alone_and_all_acknowledged(
    two_nodes, fleet, tenant
):
    victim, _, tokens, job, start = two_nodes
    with scopes_disabled():
        placed = fleet.job(tenant, node=victim, at=timezone.now(), gpu_indexes=[1])
        Job.objects.filter(pk=placed.pk).update(state="scheduled")
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(node_queue(victim.name))  # acknowledgements earlier tests left
    now = _ms(timezone.now())
    exited = {"exit_code": 0, "reason": "", "lost": False, "windows": []}
    events = [
        {"task": "agents.job_started", "body": {"job_id": placed.pk, "attempt": 1, "at_ms": now}},
        {"task": "agents.job_exited", "body": {"job_id": job.pk, "attempt": 1, "at_ms": now, **exited}},
        {"task": "agents.job_exited", "body": {"job_id": "not a number", "at_ms": now}},  # malformed
        {"task": "agents.heartbeat", "body": {}},  # not a job event
        {"task": "agents.job_exited", "body": {"job_id": placed.pk, "attempt": 1, "at_ms": now + 5, **exited}},
    ]
    link = link_for(victim.name)
    try:
        link.send(
            p.R_JOB_EVENTS, report_kwargs(token=tokens[victim.name], seqs=[7, 8, 9, 10, 11], body={"events": events})
        )
    finally:
        link.disconnect()
    ack = ack_received(client, victim.name)
    assert (ack.task, ack.body["seqs"]) == (ACK, [7, 8, 9, 10, 11])
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).state == "succeeded"
        done = Job.objects.get(pk=placed.pk)
        assert done.state == "succeeded" and done.started_at is not None  # started, then exited, in that order
        reasons = sorted(LinkRefusal.objects.filter(node=victim, task=p.R_JOB_EVENTS).values_list("reason", flat=True))
    assert len(reasons) == 2
    assert "'agents.heartbeat' is not a job event" in reasons[0] and "agents.job_exited: job_id" in reasons[1]


def test_the_agent_sends_consecutive_job_events_together_and_every_other_report_as_before():
    from agents.agent.main import EVENTS_PER_MESSAGE, _batch_at

    rows = [
        (i, task, {}, None)
        for i, task in enumerate(
            [p.R_JOB_STARTED, p.R_JOB_STARTED, p.R_JOB_EXITED, R_USAGE, R_USAGE, p.R_HEARTBEAT, p.R_JOB_EXITED]
            + [p.R_JOB_EXITED] * (EVENTS_PER_MESSAGE + 1)
        )
    ]
    batches, i = [], 0
    while i < len(rows):
        batch = _batch_at(rows, i)
        batches.append([r[1] for r in batch])
        i += len(batch)
    assert [len(b) for b in batches] == [3, 2, 1, EVENTS_PER_MESSAGE, 2]
    assert batches[0] == [p.R_JOB_STARTED, p.R_JOB_STARTED, p.R_JOB_EXITED]
    assert batches[1] == [R_USAGE, R_USAGE] and batches[2] == [p.R_HEARTBEAT]


def test_the_exits_of_a_batch_store_their_windows_in_one_ingest_before_any_of_their_jobs_ends(
    fleet, tenant, monkeypatch
):
    """An agent sends the exits of a wave of short jobs together: their last usage windows are stored as one
    ingest batch, each while its job still runs, then each exit is acted on; the same batch sent again
    (a retry, a re-send before the acknowledgement) stores and charges nothing more."""
    from agents.tasks import billing_services, job_events_task
    from billing.models import UsageWindow

    node = fleet.node("rep-batch")
    token = node_credential_issue(name=node.name)
    start = timezone.now() - timedelta(minutes=5)
    with scopes_disabled():
        jobs = [fleet.job(tenant, node=node, at=start, gpu_indexes=[i]) for i in range(4)]
    at = _ms(start) + 1_000
    events = [
        {
            "task": "agents.job_exited",
            "body": {
                "job_id": job.pk,
                "attempt": 1,
                "at_ms": at + 60_000,
                "exit_code": 0,
                "reason": "",
                "lost": False,
                "windows": [window(job, 0, at, at + 60_000)],
            },
        }
        for job in jobs
    ]
    ingests, running_then = [], []
    real = billing_services.usage_windows_ingest

    def ingest(*, node, windows):
        ingests.append(sorted(w["job_id"] for w in windows))
        with scopes_disabled():
            running_then.append(Job.objects.filter(pk__in=[j.pk for j in jobs], state="running").count())
        return real(node=node, windows=windows)

    monkeypatch.setattr(billing_services, "usage_windows_ingest", ingest)
    kwargs = report_kwargs(token=token, seqs=[1, 2, 3, 4], body={"events": events})
    job_events_task.apply(kwargs=kwargs).get()
    assert ingests == [sorted(j.pk for j in jobs)] and running_then == [4]
    with scopes_disabled():
        assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", "gpu_ms")) == {
            ("succeeded", 60_000)
        }
    job_events_task.apply(kwargs=kwargs).get()  # the same batch again
    with scopes_disabled():
        assert UsageWindow.objects.filter(job__in=jobs).count() == 4
        assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", "gpu_ms")) == {
            ("succeeded", 60_000)
        }
