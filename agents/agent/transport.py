"""The agent's only link to the platform: the broker.

Commands arrive as Celery task messages (``agent.launch``, ``agent.stop``) on
the node's own queue; reports leave as Celery task messages for the platform's
workers (queue ``platform``). A Celery app without Django formats them.
"""

from __future__ import annotations

import logging
import queue as stdqueue
from dataclasses import dataclass

from celery import Celery
from kombu import Connection, pools

from .brokerconf import PLATFORM_QUEUE, node_queue

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
        self.app = Celery("gpushare-agent", broker=url, set_as_current=False)
        self.app.conf.update(
            broker_transport_options=transport_options,
            task_serializer="json",
            accept_content=["json"],
            broker_connection_retry=False,
            broker_connection_retry_on_startup=False,
            broker_connection_max_retries=0,
        )
        self._conn: Connection | None = None
        self._queue = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def connect(self) -> None:
        conn = Connection(self.url, transport_options=self.transport_options, connect_timeout=2)
        conn.ensure_connection(max_retries=1, timeout=2)
        self._conn = conn
        self._queue = conn.SimpleQueue(self.queue_name)

    def disconnect(self) -> None:
        for closer in (getattr(self._queue, "close", None), getattr(self._conn, "release", None)):
            try:
                if closer:
                    closer()
            except Exception as exc:  # noqa: BLE001 - closing a dead connection may fail any way
                log.debug("closing the broker connection: %s", exc)
        self._conn = self._queue = None
        # Drop the producer pool too: a closed pool refuses every later send
        # ("Acquire on closed pool"), so the next send gets a fresh one.
        # (the same reset Celery does after a fork).
        pools.reset()
        self.app._pool = None
        self.app.amqp._producer_pool = None

    def receive(self, timeout: float) -> Command | None:
        """The next command, or None after ``timeout`` seconds."""
        try:
            message = self._queue.get(block=True, timeout=timeout)
        except stdqueue.Empty:
            return None
        task = message.headers.get("task", "")
        body = message.payload
        kwargs = body[1] if isinstance(body, list | tuple) and len(body) >= 2 else {}
        return Command(task=task, kwargs=kwargs or {}, message=message)

    def send(self, task: str, kwargs: dict) -> None:
        """Publish a report; raises if the broker did not take it."""
        self.app.send_task(task, kwargs=kwargs, queue=PLATFORM_QUEUE, retry=False)
