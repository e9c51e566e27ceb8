"""Django's PostgreSQL backend, with a health check that asks the server only when there is a reason to.

With ``CONN_HEALTH_CHECKS`` on, Django checks a kept connection before a request's first query, and its
PostgreSQL backend does it with ``SELECT 1``: one more round trip on every request that uses the database
(~30 us of the server's CPU and ~40 us of the web process's, a submit or a list page's ~2-5 %). A server that
ends a connection (restart, ``pg_terminate_backend``, an idle timeout of a pooler) sends a notice and closes
it, which leaves the idle socket readable; so an idle connection whose socket has nothing to read is used as
it is, and one with something to read (or not idle) is checked the usual way. A connection lost without a
word (a cable cut) is not seen by either check until a query's timeout.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base

TRANSACTION_STATUS_IDLE = 0  # psycopg2.extensions (and psycopg's pq.TransactionStatus.IDLE)


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self):
        conn = self.connection
        if conn is None or conn.closed:
            return False
        if conn.info.transaction_status == TRANSACTION_STATUS_IDLE:
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
            if not poller.poll(0):
                return True  # idle, and not a byte from the server since its last answer
        return super().is_usable()
