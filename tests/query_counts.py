"""What a query-count test counts: a request's own statements, not its token check's.

The token check is the auth cache's business (tests/accounts/test_principal_cache.py). A notice from
another test's Redis traffic (a flush, applied by the key watch's thread at its next poll) can drop a
cached check between two requests of one test, and its two reads are then not the page's."""

from __future__ import annotations

import re

AUTH_TABLES = re.compile(r'"accounts_(apitoken|membership)"')


def statements_besides_auth(queries) -> list[str]:
    """The SQL of a ``CaptureQueriesContext``'s statements that do not read or write the token tables."""
    return [q["sql"] for q in queries.captured_queries if not AUTH_TABLES.search(q["sql"])]
