"""kombu's Redis transport, hardened for queues that nodes may write to.

A node's broker user can push anything onto the report queue. Stock kombu
decodes a popped message inside its event loop, and a message that is not JSON
(or not kombu's envelope) raises there: Celery logs "Unrecoverable error" and
the worker exits, so one junk push would stop every platform worker. Here such
a message is logged and dropped instead (it was popped; nothing else is lost).

gpushare/celery.py makes this the transport of ``redis://`` URLs in platform
processes (web, worker, beat).
"""

from __future__ import annotations

import json
import logging
from queue import Empty

from kombu.transport import redis as kombu_redis

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
