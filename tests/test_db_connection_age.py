"""How long a web or worker thread keeps its database connection (``GPUSHARE_DB_CONN_MAX_AGE``): by default
for the process's life, so that no request pays for a new one (a server process forked, the prepared
statements sent again: ~15 ms on the bench machine) because a minute went by; an age in seconds recycles it
at the first request past it, as Django does; a bad value stops the process at start with the rule."""

from __future__ import annotations

import time

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished, request_started

from gpushare.settings.base import conn_max_age, database_from_url
from tests.db_connections import backend_pid, connections_kept

URL = "postgres://postgres@127.0.0.1:5432/gpushare_any"


def request(body):
    request_started.send(sender=None)
    try:
        return body()
    finally:
        request_finished.send(sender=None)


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


@pytest.mark.django_db(transaction=True)
def test_a_kept_connection_serves_requests_an_hour_apart(later):
    with connections_kept(conn_max_age(None)):
        pid = request(backend_pid)
        later(3600)
        assert request(backend_pid) == pid
        assert request(backend_pid) == pid


@pytest.mark.django_db(transaction=True)
def test_a_connection_past_its_age_is_replaced_at_the_next_request(later):
    with connections_kept(conn_max_age("60")):
        pid = request(backend_pid)
        later(30)
        assert request(backend_pid) == pid
        later(31)
        assert request(backend_pid) != pid
