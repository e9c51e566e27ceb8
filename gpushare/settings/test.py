"""Test settings: PostgreSQL and Redis are required (see `make test`)."""

import os

from .base import *  # noqa: F403
from .base import VAR_DIR, broker_options, database_from_url

DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare")
if not DATABASE_URL.startswith(("postgres://", "postgresql://")):
    raise RuntimeError("The test suite runs on PostgreSQL: set DATABASE_URL=postgres://...")
DATABASES = {"default": database_from_url(DATABASE_URL)}
if "GPUSHARE_DB_CONN_MAX_AGE" not in os.environ:  # a connection per request, unless a test's server asks
    DATABASES["default"]["CONN_MAX_AGE"] = 0

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS = broker_options(REDIS_URL, VAR_DIR)

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
