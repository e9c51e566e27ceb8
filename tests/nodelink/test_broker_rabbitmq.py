"""The same broker rules on RabbitMQ (127.0.0.1:5672), with the permissions ``node_credential`` prints.

Users are created with rabbitmqctl (root on these machines) and deleted afterwards; the test is
skipped where there is no RabbitMQ server or no rabbitmqctl.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import uuid

import pytest
from kombu import Connection, Exchange, Producer, Queue

from agents.agent.brokerconf import REPORT_QUEUE, node_queue
from agents.brokeracl import rabbitmq_permissions, rabbitmq_user

ADMIN = os.environ.get("RABBITMQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672//")


def rabbitmqctl(*args) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def rabbit():
    if not shutil.which("rabbitmqctl") or os.geteuid() != 0:
        pytest.skip("needs rabbitmqctl as root")
    try:
        with Connection(ADMIN, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no RabbitMQ at {ADMIN}: {exc}")
    made: list[str] = []

    def user_for(node: str) -> str:
        password = f"gpn_{secrets.token_urlsafe(16)}"  # as node credentials are: never a leading "-" (an option)
        rabbitmqctl("add_user", rabbitmq_user(node), password)
        made.append(rabbitmq_user(node))
        rabbitmqctl("set_permissions", "-p", "/", rabbitmq_user(node), *rabbitmq_permissions(node))
        return f"amqp://{rabbitmq_user(node)}:{password}@127.0.0.1:5672//"

    yield user_for
    for user in made:
        rabbitmqctl("delete_user", user)


def declare(channel, name: str) -> Queue:
    queue = Queue(name, Exchange(name), routing_key=name, auto_delete=True)
    queue(channel).declare()
    return queue


def test_a_nodes_rabbitmq_user_reads_only_its_queue_and_writes_only_reports(rabbit):
    from amqp.exceptions import AccessRefused

    x, y = f"rbx-{uuid.uuid4().hex[:8]}", f"rby-{uuid.uuid4().hex[:8]}"
    url_x = rabbit(x)
    rabbit(y)
    suffix = uuid.uuid4().hex[:6]
    with Connection(ADMIN) as admin:
        channel = admin.channel()
        # the platform's side: the report queue, the platform queue and y's queue exist
        declare(channel, REPORT_QUEUE)
        declare(channel, f"platform-test-{suffix}")
        declare(channel, node_queue(y))
        Producer(channel).publish({"env": "tenant secret"}, exchange=node_queue(y), routing_key=node_queue(y))

        with Connection(url_x) as as_x:
            own = as_x.SimpleQueue(node_queue(x))  # declares and consumes its own queue: allowed
            Producer(as_x.channel()).publish(
                {"report": 1}, exchange=REPORT_QUEUE, routing_key=REPORT_QUEUE, declare=[]
            )  # allowed
            own.close()

        refused = {
            "consume y's queue": lambda c: c.SimpleQueue(
                Queue(node_queue(y), Exchange(node_queue(y)), node_queue(y), auto_delete=True)
            ).get(timeout=1),
            "read the report queue": lambda c: c.SimpleQueue(
                Queue(REPORT_QUEUE, Exchange(REPORT_QUEUE), REPORT_QUEUE, auto_delete=True)
            ).get(timeout=1),
            "publish to the platform's exchange": lambda c: Producer(c.channel()).publish(
                {"task": "billing.close_month"},
                exchange=f"platform-test-{suffix}",
                routing_key=f"platform-test-{suffix}",
                declare=[],
            ),
            "publish through the default exchange": lambda c: Producer(c.channel()).publish(
                {"task": "billing.close_month"}, exchange="", routing_key=f"platform-test-{suffix}", declare=[]
            ),
        }
        for what, attempt in refused.items():
            with Connection(url_x) as as_x, pytest.raises(AccessRefused):
                attempt(as_x)
                as_x.drain_events(timeout=1)  # a refused publish is reported asynchronously
                pytest.fail(f"node x could {what}")
        # y's command is still there, unread
        message = admin.SimpleQueue(Queue(node_queue(y), Exchange(node_queue(y)), node_queue(y), auto_delete=True)).get(
            timeout=5
        )
        assert message.payload == {"env": "tenant secret"}
        message.ack()
    with Connection(ADMIN) as admin:  # what this test declared
        channel = admin.channel()
        for name in (node_queue(x), node_queue(y), REPORT_QUEUE, f"platform-test-{suffix}"):
            channel.queue_delete(name)
            channel.exchange_delete(name)
