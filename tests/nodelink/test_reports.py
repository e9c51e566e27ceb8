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
    raw = wait_for(lambda: client.rpop(node_queue(victim.name)), what="the acknowledgement on the node's queue")
    envelope = json.loads(raw)
    body = json.loads(base64.b64decode(envelope["body"]))
    verifier = CommandVerifier(
        victim.name, [public_key_parse(k) for k in nodelink.trusted_keys()], lambda nonce, expires: False
    )
    ack = verifier.verify(envelope["headers"]["task"], body[1])
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
