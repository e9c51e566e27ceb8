"""The harness retries a flush that PostgreSQL failed to break a deadlock with a running task."""

from __future__ import annotations

import pytest
from django.core.management.base import CommandError
from django.db import OperationalError

from tests import conftest


def flushes(monkeypatch, failures: list[Exception]) -> list[int]:
    calls = []

    def flush(self):
        calls.append(1)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(conftest, "_fixture_teardown", flush)
    return calls


def failed(cause: Exception) -> CommandError:
    try:
        raise CommandError("Database test couldn't be flushed.") from cause
    except CommandError as exc:
        return exc


def test_a_deadlocked_flush_is_tried_again(monkeypatch):
    calls = flushes(
        monkeypatch, [failed(OperationalError("deadlock detected")), failed(OperationalError("deadlock detected"))]
    )
    conftest._fixture_teardown_retrying(None)
    assert len(calls) == 3


@pytest.mark.parametrize("cause", [OperationalError("relation does not exist"), ValueError("deadlock")])
def test_any_other_flush_failure_is_raised_at_once(monkeypatch, cause):
    calls = flushes(monkeypatch, [failed(cause)])
    with pytest.raises(CommandError):
        conftest._fixture_teardown_retrying(None)
    assert len(calls) == 1


def test_a_deadlock_that_persists_is_raised_in_the_end(monkeypatch):
    calls = flushes(monkeypatch, [failed(OperationalError("deadlock detected")) for _ in range(3)])
    with pytest.raises(CommandError):
        conftest._fixture_teardown_retrying(None, attempts=3)
    assert len(calls) == 3
