"""The log context: request id, tenant, job and node, where known (Django-free).

Values live in one ``contextvars.ContextVar`` so they follow a web request, a
Celery task or an asyncio task without being passed around; ``ContextFilter``
copies them onto every log record, where the JSON formatter picks them up
(``extra={"job": 7}`` on one call wins over the context).
"""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar

FIELDS = ("request_id", "tenant", "job", "node", "task", "task_id")

_context: ContextVar[dict | None] = ContextVar("gpushare_log_context", default=None)


def log_context() -> dict:
    """The fields bound now (a copy)."""
    return dict(_context.get() or {})


def log_context_bind(**fields) -> None:
    """Add fields to the current context (None values are ignored)."""
    current = dict(_context.get() or {})
    current.update({k: v for k, v in fields.items() if v not in (None, "")})
    _context.set(current)


@contextlib.contextmanager
def log_context_scope(**fields):
    """Bind fields for the duration of a block (a request, a task), then restore the previous context."""
    token = _context.set({k: v for k, v in fields.items() if v not in (None, "")})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Put the context's fields on each record (as attributes the formatters can use)."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get() or {}
        for name in FIELDS:
            if getattr(record, name, None) in (None, "") and name in bound:
                setattr(record, name, bound[name])
        return True
