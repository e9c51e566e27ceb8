"""Production settings refuse every known development secret (and start with real ones), and
``manage.py check --deploy`` has nothing to say about them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
GOOD = {
    "DJANGO_SETTINGS_MODULE": "gpushare.settings.production",
    "SECRET_KEY": "q3Vb8kP1zR7mN2xT5wY9cF4hJ6gL0sD3aE8uI1oK7pQ2rV5bX9nM4",
    "DATABASE_URL": "postgres://gpushare@db.internal:5432/gpushare",
    "REDIS_URL": "redis://redis.internal:6379/0",
    "ALLOWED_HOSTS": "gpushare.example.com",
    "STRIPE_API_KEY": "sk_live_51Hxxxxxxxxxxxxxxxxxxxxxxxxx",
    "STRIPE_WEBHOOK_SECRET": "whsec_9f8e7d6c5b4a39281706f5e4d3c2b1a0",
    "PATH": "/usr/bin:/bin",
}


def django_check(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "check", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("SECRET_KEY", "dev-insecure-gpushare-key-change-me", "SECRET_KEY is a known development key"),
        ("SECRET_KEY", "change-me-in-production", "SECRET_KEY is a known development key"),
        ("SECRET_KEY", "django-insecure-" + "x1y2z3" * 10, "SECRET_KEY is a known development key"),
        ("SECRET_KEY", "short-but-not-a-known-one", "SECRET_KEY is too weak"),
        ("STRIPE_WEBHOOK_SECRET", "whsec_local", "STRIPE_WEBHOOK_SECRET is the development value whsec_local"),
        ("STRIPE_API_KEY", "sk_test_local", "STRIPE_API_KEY is a Stripe test key"),
        ("STRIPE_API_KEY", "sk_test_51Habcdefghijklmnop", "STRIPE_API_KEY is a Stripe test key"),
        ("SECRET_KEY", "", "SECRET_KEY must be set in production"),
        ("STRIPE_WEBHOOK_SECRET", "", "STRIPE_WEBHOOK_SECRET must be set in production"),
        ("ALLOWED_HOSTS", "", "ALLOWED_HOSTS must be set in production"),
        ("REDIS_URL", "", "REDIS_URL or CELERY_BROKER_URL must be set"),
        ("GPUSHARE_METRICS_TOKEN", "abc", "GPUSHARE_METRICS_TOKEN is too short"),
    ],
)
def test_production_refuses_to_start_with(name, value, says):
    env = {**GOOD, name: value}
    result = django_check(env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and says in result.stderr, result.stderr[-1500:]


def test_the_test_stripe_key_is_allowed_only_in_explicit_test_mode():
    env = {**GOOD, "STRIPE_API_KEY": "sk_test_local", "GPUSHARE_STRIPE_TEST_MODE": "1"}
    result = django_check(env)
    assert result.returncode == 0, result.stderr[-1500:]


def test_real_secrets_start_and_the_deploy_check_is_clean():
    result = django_check(GOOD, "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_production_serves_https_only_with_hsts_and_secure_cookies():
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS, "
        "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_PROXY_SSL_HEADER, s.DEBUG, s.LOG_FORMAT)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=GOOD, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "True",
        "31536000",
        "True",
        "True",
        "True",
        "('HTTP_X_FORWARDED_PROTO',",
        "'https')",
        "False",
        "json",
    ]
