"""Production settings: refuse to start without real secrets and servers."""

import os

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403

for _name in ("SECRET_KEY", "DATABASE_URL", "STRIPE_API_KEY", "STRIPE_WEBHOOK_SECRET"):
    if not os.environ.get(_name):
        raise ImproperlyConfigured(f"{_name} must be set in production")
if not (os.environ.get("REDIS_URL") or os.environ.get("CELERY_BROKER_URL")):
    raise ImproperlyConfigured("REDIS_URL or CELERY_BROKER_URL must be set in production")

DEBUG = False
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
