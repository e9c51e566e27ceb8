"""kombu's Redis transport, hardened for queues that nodes may write to.

A node's broker user can push anything onto the report queue. Stock kombu
decodes a popped message inside its event loop, and a message that is not JSON
(or not kombu's envelope) raises there: Celery logs "Unrecoverable error" and
the worker exits, so one junk push would stop every platform worker. Here such
a message is logged and dropped instead (it was popped; nothing else is lost).

It also survives the broker going away while messages are unacknowledged.
Celery then closes its connection to reconnect; closing a channel tries to
put those messages back, which needs a client, and kombu builds one from the
connection's address, which a closed connection no longer has: an
AttributeError, which Celery takes for "Unrecoverable error" and the worker
exits (seen in ``make chaos``'s broker-restart case). Here that is the
connection error it is, which the closing code ignores, and the worker
reconnects (the messages come back by the visibility timeout, as after any
lost connection).

gpushare/celery.py makes this the transport of ``redis://`` URLs in platform
processes (web, worker, beat).
"""

from __future__ import annotations

import json
import logging
from queue import Empty

from kombu.transport import redis as kombu_redis
from redis import exceptions as redis_exceptions

log = logging.getLogger(__name__)


def envelope_ok(message) -> bool:
    """Whether ``message`` has what kombu needs to build a Message and acknowledge it."""
    if not isinstance(message, dict):
        return False
    properties = message.get("properties")
    return (
        isinstance(properties, dict)
        and "delivery_tag" in properties
        and isinstance(properties.get("delivery_info", {}), dict)
        and isinstance(message.get("headers") or {}, dict)
    )


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous=False):
        if self.connection.client is None:  # its connection is closed (see the module doc)
            raise redis_exceptions.ConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous=asynchronous)

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except json.JSONDecodeError as exc:
            log.error("a message that is not JSON was taken off a queue and dropped: %s", exc)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message, queue):
        if not envelope_ok(message):
            log.error("a message that is not a kombu envelope was taken off %r and dropped: %.200r", queue, message)
            return
        super()._deliver(message, queue)
