"""The agent's only link to the platform: the broker.

Commands arrive as Celery task messages (``agent.launch``, ``agent.stop``,
``agent.register``, ``agent.ack``: signed envelopes, see ``protocol``) on the
node's own queue; reports leave as Celery task messages for the platform's
workers on the report queue (``reports``), the only queue a node's broker
credential may write to.

Publishing declares nothing (a node's credential may not create or bind
queues): on Redis a report is pushed straight onto the ``reports`` list (kombu's
anonymous exchange), on AMQP to the ``reports`` exchange the platform declared;
the embedded filesystem broker (one host, no credentials) declares as usual.
"""

from __future__ import annotations

import logging
import queue as stdqueue
from dataclasses import dataclass

from kombu import Connection, Exchange, Producer, Queue

from .brokerconf import REPORT_QUEUE, node_queue
from .protocol import task_message

log = logging.getLogger(__name__)


@dataclass
class Command:
    task: str
    kwargs: dict
    message: object

    def ack(self) -> None:
        self.message.ack()


class BrokerLink:
    def __init__(self, *, url: str, transport_options: dict, node_name: str):
        self.url = url
        self.transport_options = transport_options
        self.queue_name = node_queue(node_name)
        self._conn: Connection | None = None
        self._queue = None
        self._producer: Producer | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def connect(self) -> None:
        conn = Connection(self.url, transport_options=self.transport_options, connect_timeout=2)
        conn.ensure_connection(max_retries=1, timeout=2)
        self._conn = conn
        self._queue = conn.SimpleQueue(self.queue_name)
        self._producer = Producer(conn.channel(), serializer="json", auto_declare=False)

    def disconnect(self) -> None:
        for closer in (
            getattr(self._queue, "close", None),
            getattr(getattr(self._producer, "channel", None), "close", None),
            getattr(self._conn, "release", None),
        ):
            try:
                if closer:
                    closer()
            except Exception as exc:  # noqa: BLE001 - closing a dead connection may fail any way
                log.debug("closing the broker connection: %s", exc)
        self._conn = self._queue = self._producer = None

    def receive(self, timeout: float) -> Command | None:
        """The next command, or None after ``timeout`` seconds."""
        try:
            message = self._queue.get(block=timeout > 0, timeout=timeout or None)
        except stdqueue.Empty:
            return None
        task = message.headers.get("task", "") if isinstance(message.headers, dict) else ""
        try:
            body = message.payload
        except Exception as exc:  # noqa: BLE001 - undecodable: refused by the caller as unsigned
            log.warning("undecodable command message: %s", exc)
            body = None
        kwargs = body[1] if isinstance(body, list | tuple) and len(body) >= 2 else {}
        return Command(task=task, kwargs=kwargs if isinstance(kwargs, dict) else {}, message=message)

    def send(self, task: str, kwargs: dict) -> None:
        """Publish a report; raises if the broker did not take it."""
        task_id, body, headers = task_message(task, kwargs)
        transport = self._conn.transport_cls if self._conn else ""
        if transport in ("redis", "rediss"):
            exchange, declare = "", []  # straight onto the reports list: LPUSH reports
        elif transport in ("amqp", "pyamqp", "amqps"):
            exchange, declare = REPORT_QUEUE, []  # the platform declared and bound it
        else:  # the embedded filesystem broker
            exchange = REPORT_QUEUE
            declare = [Queue(REPORT_QUEUE, Exchange(REPORT_QUEUE), routing_key=REPORT_QUEUE)]
        self._producer.publish(
            body,
            exchange=exchange,
            routing_key=REPORT_QUEUE,
            headers=headers,
            correlation_id=task_id,
            declare=declare,
            retry=False,
        )
