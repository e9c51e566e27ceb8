"""gpushare: a multi-tenant GPU compute-sharing platform (Django project package)."""

from .celery import app as celery_app

__all__ = ("celery_app",)
