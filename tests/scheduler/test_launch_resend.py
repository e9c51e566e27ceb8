"""Launches lost between a pass's commit and its dispatch are sent again."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import redis
from django.conf import settings
from django.utils import timezone
from django_scopes import scopes_disabled

from agents.agent.brokerconf import node_queue
from agents.agent.protocol import CommandVerifier, public_key_parse
from agents.nodelink import trusted_keys
from scheduler.models import Job
from scheduler.passes import launches_resend
from scheduler.services import schedule_pass
from tests.scheduler.conftest import node_add, reload, submit


def queued_launches(node: str) -> list[dict]:
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    out = []
    for raw in client.lrange(node_queue(node), 0, -1):
        envelope = json.loads(raw)
        if envelope["headers"]["task"] == "agent.launch":
            # a signed command: its body, as the node's agent would verify it
            verifier = CommandVerifier(node, [public_key_parse(k) for k in trusted_keys()], lambda *_: False)
            signed = json.loads(base64.b64decode(envelope["body"]))[1]
            out.append(verifier.verify("agent.launch", signed).body)
    return out


@scopes_disabled()
def test_a_job_scheduled_long_ago_without_a_start_gets_its_launch_again(sched, tenant):
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(node_queue("resend-n1"))
    node_add("resend-n1", 2)
    stuck, fresh = submit(tenant, gpus=1), submit(tenant, gpus=1)
    schedule_pass()
    # As if the worker died after the pass committed and before it sent anything.
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(node_queue("resend-n1"))
    Job.objects.filter(pk=stuck.pk).update(scheduled_at=timezone.now() - timedelta(minutes=2))

    assert launches_resend(older_than_s=30) == 1
    [payload] = queued_launches("resend-n1")
    assert payload["job_id"] == stuck.pk and payload["attempt"] == reload(stuck).attempt
    assert len(payload["gpu_uuids"]) == 1 and payload["share_milli"] == 1000
    # A job placed just now, or one that reported its start, is left alone.
    assert reload(fresh).state == "scheduled"
    Job.objects.filter(pk=stuck.pk).update(state="running")
    assert launches_resend(older_than_s=30) == 0
