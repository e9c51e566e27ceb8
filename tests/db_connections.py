"""Helpers for the tests of how a process keeps its database connection."""

from __future__ import annotations

from contextlib import contextmanager

from django.db import connection


def backend_pid() -> int:
    """The PostgreSQL server process behind this thread's connection (a new one: a new connection)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


@contextmanager
def connections_kept(max_age: int | None):
    """This thread's connection kept by the rule of a deployment (``CONN_MAX_AGE`` ``max_age``, health
    checks on), not the test settings' connection per request; as it was afterwards."""
    saved = {k: connection.settings_dict[k] for k in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
    connection.close()
    connection.settings_dict.update(CONN_MAX_AGE=max_age, CONN_HEALTH_CHECKS=True)
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.update(saved)
