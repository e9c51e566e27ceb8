"""Many small transactions that wait for the disk once: :func:`flushed_once`.

A node's batch of job starts and exits (``agents.tasks.job_events_task``) is one transaction per event, and
each ``COMMIT`` waited for its WAL to reach the disk (an ``fdatasync``), though the agent keeps every report
until the platform acknowledges it. Inside ``flushed_once()`` transactions commit with PostgreSQL's
``synchronous_commit = off``: at once, their WAL written and flushed by the server shortly after. On the way
out, one transaction that writes a single WAL record commits synchronously: that waits until the WAL is on
disk up to its own commit record, so every commit made before it is durable before the
caller goes on (acknowledges the batch).

What it risks: a server crash before that last flush loses the commits made inside, and nothing else, since
the report was not acknowledged yet, the agent sends it again and the handlers are idempotent. Nothing that
reads those commits can outlive them: the WAL is one sequence, so any synchronous commit after them (a
scheduling pass that placed a job on GPUs an exit freed) makes them durable first. See PostgreSQL's
"Asynchronous Commit" chapter.
"""

from __future__ import annotations

from contextlib import contextmanager

from django.db import DatabaseError, connection, transaction


@contextmanager
def flushed_once():
    """Commits inside do not each wait for the disk; all are on disk when the block ends without an error.
    Inside a transaction already (nothing commits inside), or off PostgreSQL, it changes nothing."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit TO off")
    try:
        yield
    finally:
        try:
            with connection.cursor() as cursor:
                cursor.execute("RESET synchronous_commit")
        except DatabaseError:
            connection.close()  # never leave a session that commits without waiting to whoever uses it next
            raise
    with transaction.atomic(), connection.cursor() as cursor:
        # One WAL record of its own (a transactional logical-decoding message, which decoders skip by its
        # prefix): a commit that wrote WAL waits until the WAL is on disk up to it. A transaction that only
        # took an id writes no WAL, and PostgreSQL does not wait for its commit.
        cursor.execute("SELECT pg_logical_emit_message(true, 'gpushare.flush', '')")
