"""The database health check before a request's first query (gpushare.db.postgresql): an idle connection the
server has said nothing on is used without a round trip; one the server ended is found out and replaced
before the request's query fails; a connection that is not idle is asked, as Django does."""

from __future__ import annotations

import psycopg2
import pytest
from django.conf import settings
from django.db import connection
from django.db.backends.postgresql.base import DatabaseWrapper as DjangosWrapper

from tests.db_connections import backend_pid

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's backend"),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def asked(monkeypatch):
    """How many times the check asked the server (Django's own SELECT 1)."""
    calls = []
    real = DjangosWrapper.is_usable
    monkeypatch.setattr(DjangosWrapper, "is_usable", lambda self: calls.append(1) or real(self))
    return calls


def terminate(pid: int) -> None:
    db = settings.DATABASES["default"]
    other = psycopg2.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"], dbname=db["NAME"]
    )
    other.autocommit = True
    with other.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        assert cursor.fetchone()[0] is True
    other.close()


def test_an_idle_quiet_connection_is_used_without_asking(asked):
    backend_pid()
    assert connection.is_usable() is True
    assert asked == []


def test_a_connection_the_server_ended_is_found_out_and_replaced(asked):
    import time

    pid = backend_pid()
    terminate(pid)
    for _ in range(100):  # the server's notice reaches the socket
        time.sleep(0.01)
        if connection.connection.closed or not connection.is_usable():
            break
    assert connection.is_usable() is False
    assert asked  # the socket said something: the server was asked (and the query failed)
    connection.health_check_done = False  # a new request
    connection.close_if_health_check_failed()
    assert backend_pid() != pid  # a new connection, no error


def test_a_connection_in_a_transaction_is_asked(asked):
    from django.db import transaction

    backend_pid()
    with transaction.atomic():
        backend_pid()
        assert connection.is_usable() is True
    assert asked == [1]
