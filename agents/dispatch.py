"""The platform's one sender to node agents: every command signed, on the node's own queue.

``nodes_send([(node, task, body), ...])`` signs each command (agents.nodelink,
protocol in ``agents.agent.protocol``) and publishes it as a Celery task
message. On Redis the messages are written in kombu's envelope straight onto
each node's queue list in one pipeline (``send_task``'s per-message overhead,
about 1 ms, dominated a scheduling pass of thousands of launches); other brokers
go through kombu.
"""

from __future__ import annotations

import base64
import json
from uuid import uuid4

import redis
from django.conf import settings

from .agent.brokerconf import node_queue
from .agent.protocol import ACK, task_message
from .nodelink import signer


def node_send(node_name: str, task: str, payload: dict) -> None:
    """Send ``task`` (``agent.launch``, ``agent.stop``...) to ``node_name``'s agent."""
    nodes_send([(node_name, task, payload)])


def ack_send(node_name: str, seqs) -> None:
    """Tell ``node_name``'s agent that its reports ``seqs`` are stored (it drops them from its outbox)."""
    if seqs:
        nodes_send([(node_name, ACK, {"seqs": sorted(set(seqs))})])


def nodes_send(messages: list[tuple[str, str, dict]]) -> None:
    """Sign and send (node, task, body) commands to the nodes' queues."""
    if not messages:
        return
    sign = signer().sign
    signed = [(node, task, sign(node, task, body)) for node, task, body in messages]
    broker = settings.CELERY_BROKER_URL
    if broker.startswith(("redis://", "rediss://")):
        _redis_push(broker, signed)
    else:
        _kombu_publish(signed)


def _redis_push(broker: str, messages: list[tuple[str, str, dict]]) -> None:
    client = redis.Redis.from_url(broker, socket_timeout=10)
    with client.pipeline(transaction=False) as pipe:
        for i, (node, task, payload) in enumerate(messages, 1):
            queue = node_queue(node)
            task_id, body, headers = task_message(task, payload)
            envelope = {
                "body": base64.b64encode(json.dumps(body).encode()).decode(),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": headers,
                "properties": {
                    "correlation_id": task_id,
                    "reply_to": "",
                    "delivery_mode": 2,
                    "priority": 0,
                    "delivery_info": {"exchange": queue, "routing_key": queue},
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid4()),
                },
            }
            pipe.lpush(queue, json.dumps(envelope))
            if i % 1000 == 0:
                pipe.execute()
        pipe.execute()


def _kombu_publish(messages: list[tuple[str, str, dict]]) -> None:
    from kombu.common import maybe_declare

    from gpushare.celery import app

    with app.producer_or_acquire() as producer, producer.batch(max_size=1000):
        for node, task, payload in messages:
            queue = app.amqp.queues[node_queue(node)]
            maybe_declare(queue, producer.channel)
            task_id, body, headers = task_message(task, payload)
            producer.publish(
                body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                serializer="json",
                retry=True,
                headers=headers,
                correlation_id=task_id,
            )
