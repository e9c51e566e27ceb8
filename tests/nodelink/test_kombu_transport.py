"""The platform's kombu Redis transport (agents/kombu_redis.py) when the broker goes away."""

from __future__ import annotations

import pytest
from django.conf import settings
from kombu import Connection, Exchange, Queue

from agents.kombu_redis import Transport


@pytest.fixture
def connection():
    conn = Connection(settings.REDIS_URL, transport=Transport)
    yield conn
    conn.release()


def test_a_channel_closed_after_its_connection_closes_with_a_connection_error(connection):
    """The broker restarts while a message is unacknowledged: Celery closes its connection to reconnect, and
    the channel's close, putting the message back, finds the connection's address gone. That must be a
    connection error (kombu's close ignores those; the worker reconnects), not an AttributeError (Celery's
    "Unrecoverable error": the worker exits)."""
    channel = connection.channel()
    queue = Queue("gpushare-test-unacked", Exchange("gpushare-test-unacked"), "k", channel=channel)
    queue.declare()
    queue.purge()
    connection.Producer(channel).publish({"n": 1}, exchange=queue.exchange, routing_key="k", declare=[queue])
    message = queue.get(no_ack=False)
    assert message is not None and message.payload == {"n": 1}  # delivered, not acknowledged
    channel._disconnect_pools()  # as Channel.close does first...
    connection.transport.client = None  # ...with the connection closed under it (kombu's _do_close_transport)
    with pytest.raises(connection.connection_errors) as raised:
        channel.close()
    assert "closed" in str(raised.value)
    connection.maybe_close_channel(channel)  # what Connection.close does with it: nothing escapes
