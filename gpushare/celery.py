"""The platform's Celery application (web, worker and beat share it)."""

import os

from celery import Celery
from celery.signals import task_postrun, task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")

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
