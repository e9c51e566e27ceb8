"""One scheduling pass at a time, across every worker process and machine."""

from __future__ import annotations

from django.db import connection

SCHEDULER_LOCK_KEY = 0x6770_7573  # "gpus"


def pass_lock_acquire() -> None:
    """Take the scheduler lock for the rest of the current transaction.

    PostgreSQL: a transaction-level advisory lock, released at commit or
    rollback, so a crashed pass can never leave it held. SQLite (the embedded
    demo) serialises writers already: transactions start IMMEDIATE.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEDULER_LOCK_KEY])
