"""The platform's Celery application (web, worker and beat share it)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")

app = Celery("gpushare")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
