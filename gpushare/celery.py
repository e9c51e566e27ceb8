"""The platform's Celery application (web, worker and beat share it)."""

import atexit
import os
import shutil

from celery import Celery
from celery.signals import task_postrun, task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
# A worker or beat that serves metrics (GPUSHARE_METRICS_PORT) counts its pool's tasks in
# files the scrape adds up (prometheus-client's multiprocess mode): the directory must be
# chosen before prometheus_client is first imported, and be fresh for each start.
if os.environ.get("GPUSHARE_METRICS_PORT") and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from gpushare.observability.multiproc import metrics_dir_create

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir = metrics_dir_create("gpushare-metrics-")
    _metrics_owner = os.getpid()  # the pool's children exit too: only this process removes it
    atexit.register(lambda: os.getpid() == _metrics_owner and shutil.rmtree(_metrics_dir, ignore_errors=True))

app = Celery("gpushare")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Database connections in the worker: as in the web, not one per task.
# Celery's Django fixup closes every connection after every task unless
# CELERY_DB_REUSE_MAX is set; a fresh PostgreSQL connection per metering batch
# or scheduling pass costs more than many of those tasks' own queries. With the
# fixup's recycling out of the way, each task starts and ends the way a web
# request does: ``close_old_connections`` drops a connection past CONN_MAX_AGE
# or broken by an error, and arms CONN_HEALTH_CHECKS, so a connection the
# server killed while idle is replaced before the task's first query.
app.conf.CELERY_DB_REUSE_MAX = 1 << 62


@task_prerun.connect
@task_postrun.connect
def _connections_tidy(**_kwargs) -> None:
    from django.db import close_old_connections

    close_old_connections()


# Production running: logging, task metrics and log context, heartbeat and ops server
# (gpushare/observability/worker.py says what each does).
def _observability_connect() -> None:
    from celery import signals

    from gpushare.observability import worker as ops

    signals.setup_logging.connect(ops.logging_setup, weak=False)
    signals.task_prerun.connect(ops.task_prerun, weak=False)
    signals.task_postrun.connect(ops.task_postrun, weak=False)
    signals.worker_ready.connect(ops.worker_ready, weak=False)
    signals.worker_shutting_down.connect(ops.worker_shutting_down, weak=False)
    signals.beat_init.connect(ops.beat_init, weak=False)


_observability_connect()
