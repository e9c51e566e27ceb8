"""Production settings: refuse to start without real secrets and servers, and serve over HTTPS only.

Refused at start (ImproperlyConfigured, naming the variable to set):
- a missing SECRET_KEY, DATABASE_URL, ALLOWED_HOSTS, STRIPE_API_KEY, STRIPE_WEBHOOK_SECRET,
  or broker (REDIS_URL / CELERY_BROKER_URL);
- a known development secret: the demo's SECRET_KEY (and the old compose default), any
  ``django-insecure-`` key or one Django's own deploy check calls weak, ``whsec_local``, and a
  Stripe *test* key (``sk_test_local`` included) unless GPUSHARE_STRIPE_TEST_MODE=1 says this
  deployment is a test one on purpose.

Behind a TLS-terminating proxy that sets ``X-Forwarded-Proto``: HTTP is redirected to HTTPS,
HSTS for a year (subdomains, preload-eligible), cookies only over HTTPS, JSON logs.
"""

import os

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import CELERY_BEAT_SCHEDULE, env_bool, logging_config

# Values that have been public in this repository (defaults, demos, docs): never a real secret.
KNOWN_DEV_SECRET_KEYS = frozenset({"dev-insecure-gpushare-key-change-me", "change-me-in-production"})
KNOWN_DEV_WEBHOOK_SECRETS = frozenset({"whsec_local"})
STRIPE_TEST_PREFIXES = ("sk_test_", "rk_test_")


def production_refusals(environ) -> list[str]:
    """Why these settings must not start (empty: they may). Pure, so the rules are easy to read and test."""
    problems = []
    for name in ("SECRET_KEY", "DATABASE_URL", "ALLOWED_HOSTS", "STRIPE_API_KEY", "STRIPE_WEBHOOK_SECRET"):
        if not environ.get(name, "").strip():
            problems.append(f"{name} must be set in production")
    if not (environ.get("REDIS_URL") or environ.get("CELERY_BROKER_URL")):
        problems.append("REDIS_URL or CELERY_BROKER_URL must be set in production")
    key = environ.get("SECRET_KEY", "")
    if key and (key in KNOWN_DEV_SECRET_KEYS or key.startswith("django-insecure-")):
        problems.append("SECRET_KEY is a known development key: generate one, e.g. `openssl rand -base64 48`")
    elif key and (len(key) < 50 or len(set(key)) < 5):
        problems.append("SECRET_KEY is too weak (50+ characters, 5+ distinct): e.g. `openssl rand -base64 48`")
    if environ.get("STRIPE_WEBHOOK_SECRET", "") in KNOWN_DEV_WEBHOOK_SECRETS:
        problems.append("STRIPE_WEBHOOK_SECRET is the development value whsec_local: use your endpoint's secret")
    stripe_key = environ.get("STRIPE_API_KEY", "")
    test_mode = environ.get("GPUSHARE_STRIPE_TEST_MODE", "").strip().lower() in {"1", "true", "yes", "on"}
    if stripe_key.startswith(STRIPE_TEST_PREFIXES) and not test_mode:
        problems.append(
            f"STRIPE_API_KEY is a Stripe test key ({stripe_key[:8]}...): use a live key, "
            "or set GPUSHARE_STRIPE_TEST_MODE=1 if this deployment collects no real money on purpose"
        )
    token = environ.get("GPUSHARE_METRICS_TOKEN", "")
    if token and len(token) < 16:
        problems.append("GPUSHARE_METRICS_TOKEN is too short (16+ characters): e.g. `openssl rand -hex 24`")
    return problems


_problems = production_refusals(os.environ)
if _problems:
    raise ImproperlyConfigured("; ".join(_problems))

DEBUG = False
STRIPE_TEST_MODE = env_bool("GPUSHARE_STRIPE_TEST_MODE", False)
# Production never invents a command-signing key: `manage.py nodelink_keygen` creates it (operator guide).
GPUSHARE["NODELINK_AUTO_KEY"] = env_bool("GPUSHARE_NODELINK_AUTO_KEY", False)

# HTTPS only, behind a proxy that terminates TLS and sets X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("GPUSHARE_SSL_REDIRECT", True)
SECURE_HSTS_SECONDS = int(os.environ.get("GPUSHARE_HSTS_SECONDS", str(365 * 24 * 3600)))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("GPUSHARE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("GPUSHARE_HSTS_PRELOAD", True)
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

LOG_FORMAT = os.environ.get("LOG_FORMAT", "json")
LOGGING = logging_config(
    fmt=LOG_FORMAT,
    level=os.environ.get("LOG_LEVEL", "INFO"),
    periodic_tasks=[entry["task"] for entry in CELERY_BEAT_SCHEDULE.values()],
)
