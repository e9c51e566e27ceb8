"""How long a web or worker thread keeps its database connection (``GPUSHARE_DB_CONN_MAX_AGE``): by default
for the process's life, so that no request pays for a new one (a server process forked, the prepared
statements sent again: ~15 ms on the bench machine) because a minute went by; an age in seconds recycles it
at the first request past it, as Django does; a bad value stops the process at start with the rule."""

from __future__ import annotations

import time

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished, request_started
from django.db import connection

from gpushare.settings.base import conn_max_age, database_from_url

URL = "postgres://postgres@127.0.0.1:5432/gpushare_any"


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def request(body):
    request_started.send(sender=None)
    try:
        return body()
    finally:
        request_finished.send(sender=None)


@pytest.fixture
def kept_for(transactional_db):
    """Connections of the test's thread kept by the rule given: ``kept_for(max_age)``."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's connections")
    saved = {k: connection.settings_dict[k] for k in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
    connection.close()

    def rule(max_age):
        connection.settings_dict.update(CONN_MAX_AGE=max_age, CONN_HEALTH_CHECKS=True)

    yield rule
    connection.close()
    connection.settings_dict.update(saved)


@pytest.fixture
def later(monkeypatch):
    """Move the clock Django ages connections by: ``later(seconds)``."""
    offset = [0.0]
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + offset[0])
    return lambda seconds: offset.__setitem__(0, offset[0] + seconds)


def test_by_default_a_connection_is_kept_for_the_process_life(monkeypatch):
    monkeypatch.delenv("GPUSHARE_DB_CONN_MAX_AGE", raising=False)
    config = database_from_url(URL)
    assert config["CONN_MAX_AGE"] is None
    assert config["CONN_HEALTH_CHECKS"] is True  # a connection the server ended is still replaced


def test_an_age_in_seconds_is_taken(monkeypatch):
    monkeypatch.setenv("GPUSHARE_DB_CONN_MAX_AGE", "300")
    assert database_from_url(URL)["CONN_MAX_AGE"] == 300
    assert conn_max_age("0") == 0
    assert conn_max_age(" ") is None


@pytest.mark.parametrize("value", ["-1", "1.5", "forever", "60s"])
def test_a_bad_age_is_refused_with_the_rule(value):
    with pytest.raises(ImproperlyConfigured, match=r"GPUSHARE_DB_CONN_MAX_AGE=.*whole seconds >= 0"):
        conn_max_age(value)


def test_a_kept_connection_serves_requests_an_hour_apart(kept_for, later):
    kept_for(conn_max_age(None))
    pid = request(backend_pid)
    later(3600)
    assert request(backend_pid) == pid
    assert request(backend_pid) == pid


def test_a_connection_past_its_age_is_replaced_at_the_next_request(kept_for, later):
    kept_for(conn_max_age("60"))
    pid = request(backend_pid)
    later(30)
    assert request(backend_pid) == pid
    later(31)
    assert request(backend_pid) != pid
