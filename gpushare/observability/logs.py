"""The ``LOGGING`` settings: JSON lines in production, human lines in ``make run``.

``LOG_FORMAT=json`` (production's default) writes one JSON object a line
through python-json-logger, with ``time``, ``level``, ``logger``, ``message``
and, where known, ``request_id``, ``tenant``, ``job``, ``node``, ``task`` and
``task_id`` (see ``context``). ``LOG_FORMAT=plain`` (the development default)
writes ``time level logger: message [job=7 node=n1]``.

Periodic tasks (and each node's heartbeat) are quiet: beat's "sending due task" lines and the worker's
"received"/"succeeded" lines of a task in ``CELERY_BEAT_SCHEDULE`` are logged
at DEBUG, except the "succeeded" line of a run that did something (a return
value that is not empty, zero or a dict of zeros: ``{'placed': 0, 'pending':
3}`` is a pass that placed nothing). ``LOG_LEVEL=DEBUG`` shows them all.
"""

from __future__ import annotations

import ast
import logging

from .context import FIELDS

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(context)s"
JSON_FORMAT = "%(levelname)s %(name)s %(message)s"
# Keys of a periodic task's dict result that describe the state, not work done.
STATE_KEYS = frozenset({"pending", "seconds"})
# Tasks that arrive on a clock without beat: each node's heartbeat, every few seconds.
ROUTINE_TASKS = ("agents.heartbeat",)
# Chatter that says nothing to an operator: kombu's filesystem and Redis URLs without a host.
DROPPED_PREFIXES = ("No hostname was supplied",)


class PlainFormatter(logging.Formatter):
    """Human lines, with the context's fields appended in brackets."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, None) not in (None, "")]
        record.context = f" [{' '.join(parts)}]" if parts else ""
        return super().format(record)


def did_something(value_repr: str) -> bool:
    """Whether a task's (repr'd) return value says it did some work."""
    try:
        value = ast.literal_eval(value_repr)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return True  # not a literal (or cut short): say so rather than hide it
    if isinstance(value, dict):
        return any(v for k, v in value.items() if k not in STATE_KEYS)
    return bool(value)


class PeriodicTaskFilter(logging.Filter):
    """Demote the routine lines of periodic tasks to DEBUG (dropped unless DEBUG is on)."""

    def __init__(self, tasks=(), name: str = ""):
        super().__init__(name)
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        if record.name == "celery.beat":
            return self._demote(record)  # beat only ever sends periodic tasks
        args = record.args if isinstance(record.args, dict) else {}
        if args.get("name") not in self.tasks:
            return True
        if "return_value" in args and did_something(str(args["return_value"])):
            return True
        return self._demote(record)

    @staticmethod
    def _demote(record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class DropFilter(logging.Filter):
    """Drop records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes=(), name: str = ""):
        super().__init__(name)
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def logging_config(*, fmt: str = "plain", level: str = "INFO", periodic_tasks=()) -> dict:
    """The dictConfig for every platform process (web, worker, beat, gateway)."""
    if fmt not in ("plain", "json"):
        raise ValueError(f"LOG_FORMAT must be 'plain' or 'json', not {fmt!r}")
    level = level.upper()
    quiet = {"handlers": ["console"], "level": level, "propagate": False, "filters": ["periodic"]}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "context": {"()": "gpushare.observability.context.ContextFilter"},
            "periodic": {
                "()": "gpushare.observability.logs.PeriodicTaskFilter",
                "tasks": [*periodic_tasks, *ROUTINE_TASKS],
            },
            "chatter": {"()": "gpushare.observability.logs.DropFilter", "prefixes": list(DROPPED_PREFIXES)},
        },
        "formatters": {
            "plain": {"()": "gpushare.observability.logs.PlainFormatter", "format": PLAIN_FORMAT},
            "json": {
                "()": "pythonjsonlogger.json.JsonFormatter",
                "format": JSON_FORMAT,
                "rename_fields": {"levelname": "level", "name": "logger"},
                "timestamp": "time",  # ISO 8601, UTC, with milliseconds
            },
        },
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": fmt, "filters": ["context"]}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django.db.backends": {"level": "WARNING"},
            "celery.beat": quiet,
            "celery.app.trace": quiet,
            "celery.worker.strategy": quiet,
            "kombu.connection": {"filters": ["chatter"]},
            # One line per process start and per lockout is enough from django-axes.
            "axes": {"level": "WARNING" if level == "INFO" else level},
        },
    }
