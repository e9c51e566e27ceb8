"""What the Celery worker and beat run beside their work (connected in ``gpushare/celery.py``).

- Logging: Django's ``LOGGING`` (JSON or human lines), not Celery's own
  handlers; each task's lines carry ``task``, ``task_id`` and, from its
  keyword arguments, ``job`` and ``node``.
- Task metrics: counts by outcome and run time (``metrics``).
- A heartbeat thread (``heartbeat``): every ``GPUSHARE_HEARTBEAT_S`` (5 s) it
  checks the broker (and, for the worker, the database; for beat, that the
  scheduler loop ticked recently) and writes the result for the readiness
  probe.
- When ``GPUSHARE_METRICS_PORT`` is set, an ops server on
  ``GPUSHARE_METRICS_ADDR`` (default 127.0.0.1) with ``/healthz``,
  ``/readyz`` and ``/metrics`` (``GPUSHARE_METRICS_TOKEN`` if set). Beat's
  ``/metrics`` also reports the depth of every queue (one beat per platform,
  so the figure is reported once).
"""

from __future__ import annotations

import logging
import logging.config
import os
import threading
import time

from celery.beat import PersistentScheduler

from .context import _context
from .heartbeat import heartbeat_write

log = logging.getLogger("gpushare.ops")

HEARTBEAT_S = float(os.environ.get("GPUSHARE_HEARTBEAT_S", "5"))
TICK_STALE_S = 60.0  # beat's loop wakes at least every few seconds with our schedule

_task_tokens: dict[str, object] = {}
_state = {"consuming": False, "stopping": False, "last_tick": 0.0}
_server = None


# --- logging and per-task context ------------------------------------------------------------


def logging_setup(loglevel=None, **_kwargs) -> None:
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel and os.environ.get("LOG_LEVEL") is None:
        logging.getLogger().setLevel(loglevel)


def task_prerun(task_id=None, task=None, kwargs=None, **_kwargs) -> None:
    from . import metrics

    kwargs = kwargs or {}
    fields = {"task": getattr(task, "name", None), "task_id": task_id, "job": kwargs.get("job_id")}
    if isinstance(kwargs.get("node"), str):
        fields["node"] = kwargs["node"]
    _task_tokens[task_id] = _context.set({k: v for k, v in fields.items() if v is not None})
    metrics.task_started(task_id)


def task_postrun(task_id=None, task=None, state=None, **_kwargs) -> None:
    from . import metrics

    metrics.task_finished(getattr(task, "name", "?"), task_id, state)
    token = _task_tokens.pop(task_id, None)
    if token is not None:
        try:
            _context.reset(token)
        except ValueError:
            _context.set(None)


# --- heartbeat and ops server ----------------------------------------------------------------


def _checks(role: str) -> dict[str, str]:
    from .health import checks_run

    results = checks_run(["broker", "database"] if role == "worker" else ["broker"])
    if role == "worker":
        results["consumer"] = "ok" if _state["consuming"] and not _state["stopping"] else "not consuming"
    else:
        age = time.monotonic() - _state["last_tick"] if _state["last_tick"] else None
        results["scheduler"] = "ok" if age is not None and age < TICK_STALE_S else "the schedule loop is not ticking"
    return results


def _beat_loop(role: str) -> None:
    while True:
        try:
            results = _checks(role)
            heartbeat_write(role, ok=all(v == "ok" for v in results.values()), checks=results)
        except Exception:
            log.exception("%s heartbeat failed", role)
        time.sleep(HEARTBEAT_S)


def _serve(role: str) -> None:
    global _server
    port = os.environ.get("GPUSHARE_METRICS_PORT")
    if not port:
        return
    from agents.agent.opsserver import OpsServer

    from .heartbeat import heartbeat_read
    from .metrics import scrape_registry

    _server = OpsServer(
        host=os.environ.get("GPUSHARE_METRICS_ADDR", "127.0.0.1"),
        port=int(port),
        live=lambda: (True, {"ok": True, "role": role}),
        ready=lambda: heartbeat_read(role, max_age_s=max(30.0, HEARTBEAT_S * 6)),
        registry=lambda: scrape_registry(queue_depth=role == "beat"),
        token=os.environ.get("GPUSHARE_METRICS_TOKEN", ""),
    ).start()


def ops_start(role: str) -> None:
    threading.Thread(target=_beat_loop, args=(role,), name=f"{role}-heartbeat", daemon=True).start()
    _serve(role)


def worker_ready(**_kwargs) -> None:
    _state["consuming"] = True
    ops_start("worker")


def worker_shutting_down(**_kwargs) -> None:
    _state["stopping"] = True


def beat_init(**_kwargs) -> None:
    ops_start("beat")


class HeartbeatScheduler(PersistentScheduler):
    """Celery's default scheduler, noting each tick for beat's readiness."""

    def tick(self, *args, **kwargs):
        _state["last_tick"] = time.monotonic()
        return super().tick(*args, **kwargs)
