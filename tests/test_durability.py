"""``gpushare.db.durability.flushed_once``: transactions inside commit without waiting for the disk, the
block ends with all of them on disk, and the session never keeps committing that way afterwards."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from gpushare.db.durability import flushed_once

pytestmark = [
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's synchronous_commit"),
    pytest.mark.django_db(transaction=True),
]


def _one(sql: str):
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]


def _write() -> None:
    """A committed transaction that writes: its commit record is in the WAL."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE IF NOT EXISTS durability_probe (n int)")
        cursor.execute("INSERT INTO durability_probe VALUES (1)")


def test_commits_inside_do_not_wait_and_all_are_on_disk_when_it_ends():
    with flushed_once():
        assert _one("SHOW synchronous_commit") == "off"
        for _ in range(20):
            _write()
        written = _one("SELECT pg_current_wal_insert_lsn()::text")
    assert _one("SHOW synchronous_commit") == "on"
    # Flushed up to (at least) every commit made inside, before the caller goes on to acknowledge them.
    assert _one(f"SELECT pg_current_wal_flush_lsn() >= '{written}'::pg_lsn")


def test_an_error_inside_leaves_the_session_committing_as_usual():
    with pytest.raises(ZeroDivisionError), flushed_once():
        _write()
        1 / 0  # noqa: B018 - the handler's error
    assert _one("SHOW synchronous_commit") == "on"


def test_inside_a_transaction_it_changes_nothing():
    with transaction.atomic():
        with flushed_once():
            assert _one("SHOW synchronous_commit") == "on"
        assert _one("SHOW synchronous_commit") == "on"
