"""The broker enforces the node link too: Redis 7 ACLs from ``manage.py node_credential``, on the real server.

A node's broker user reads only its own queue and writes only the report
queue; the broker itself refuses the rest. A real agent runs a job end to end
under that user, so the ACL is also enough.
"""

from __future__ import annotations

import secrets
import uuid
from io import StringIO
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from django.conf import settings
from django.core.management import call_command

from agents.agent.brokerconf import REPORT_QUEUE, node_queue, node_redis_keys
from agents.brokeracl import redis_acl_rules, redis_user
from agents.dispatch import node_send
from agents.models import Node
from tests.agents.conftest import unique_node_name
from tests.factories import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def url_as(user: str, password: str) -> str:
    parts = urlsplit(settings.REDIS_URL)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port or 6379}"))


@pytest.fixture
def acl_users():
    """``make(node) -> broker URL``: a Redis ACL user per node, deleted afterwards."""
    admin = redis.Redis.from_url(settings.REDIS_URL)
    made = []

    def make(node: str) -> str:
        password = secrets.token_urlsafe(16)
        admin.execute_command("ACL", "SETUSER", redis_user(node), *redis_acl_rules(node, password))
        made.append(redis_user(node))
        return url_as(redis_user(node), password)

    yield make
    for user in made:
        admin.execute_command("ACL", "DELUSER", user)


def test_a_nodes_broker_user_reads_only_its_queue_and_writes_only_reports(acl_users):
    x, y = f"aclx-{uuid.uuid4().hex[:8]}", f"acly-{uuid.uuid4().hex[:8]}"
    as_x = redis.Redis.from_url(acl_users(x))
    acl_users(y)
    admin = redis.Redis.from_url(settings.REDIS_URL)
    admin.lpush(node_queue(y), "a command for y, with a tenant's environment")
    try:
        as_x.lpush(node_queue(x), "ok")
        assert as_x.brpop([node_queue(x)], timeout=1)  # its own queue: allowed
        as_x.hset(node_redis_keys(x)["unacked_key"], "tag", "m")  # its own unacked bookkeeping
        assert as_x.lpush(REPORT_QUEUE, "a report") >= 1  # the report queue: write only
        refused = {
            "read y's queue": lambda: as_x.brpop([node_queue(y)], timeout=1),
            "peek y's queue": lambda: as_x.lrange(node_queue(y), 0, -1),
            "read the reports": lambda: as_x.lrange(REPORT_QUEUE, 0, -1),
            "pop the reports": lambda: as_x.rpop(REPORT_QUEUE),
            "write the platform queue": lambda: as_x.lpush("platform", "billing.close_month"),
            "read the shared unacked hash": lambda: as_x.hgetall("unacked"),
            "read y's unacked hash": lambda: as_x.hgetall(node_redis_keys(y)["unacked_key"]),
            "rebind the report exchange": lambda: as_x.sadd(f"_kombu.binding.{REPORT_QUEUE}", "platform"),
            "write y's queue": lambda: as_x.lpush(node_queue(y), "forged"),
            "list keys": lambda: as_x.keys("*"),
            "flush": lambda: as_x.flushdb(),
        }
        for what, attempt in refused.items():
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
                pytest.fail(f"node x could {what}")
        assert admin.llen(node_queue(y)) == 1
    finally:
        admin.delete(node_queue(x), node_queue(y), node_redis_keys(x)["unacked_key"])
        admin.lrem(REPORT_QUEUE, 0, "a report")


def test_a_real_agent_runs_a_job_under_its_acl_user(agent_factory, acl_users, tmp_path):
    node = unique_node_name()
    agent = agent_factory(node, gpus="sim:1xH100-80GB", extra=["--broker", acl_users(node)])
    marker = tmp_path / "acl.ran"
    node_send(
        node,
        "agent.launch",
        {
            "job_id": 9401,
            "attempt": 1,
            "command": ["sh", "-c", f"echo ran > {marker}"],
            "env": {},
            "gpu_uuids": [],
            "max_runtime_s": 60,
            "grace_s": 2,
        },
    )
    wait_for(marker.exists, timeout=30, what=f"the job to run (agent log: {agent.log()[-1500:]})")
    assert Node.objects.get(name=node).state == Node.State.UP
    assert "NOPERM" not in agent.log() and "no permissions" not in agent.log()


def test_node_credential_prints_the_acl_and_rabbitmq_lines(db):
    out = StringIO()
    call_command("node_credential", "gpu-node-9", "--broker-password", "s3cret", stdout=out)
    text = out.getvalue()
    assert "user gpushare-node-gpu-node-9 on >s3cret" in text
    assert "~node.gpu-node-9 " in text and "%W~reports" in text
    assert "rabbitmqctl set_permissions -p / gpushare-node-gpu-node-9 '^node\\.gpu\\-node\\-9$'" in text
    assert text.strip().splitlines()[-1].startswith("gpn_")
