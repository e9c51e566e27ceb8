"""Settings shared by every environment, read from environment variables.

| variable | default | meaning |
|---|---|---|
| DATABASE_URL | sqlite:///<repo>/var/gpushare.sqlite3 | the database (PostgreSQL in production) |
| REDIS_URL / CELERY_BROKER_URL | filesystem:// (embedded, under var/) | the Celery broker |
| SECRET_KEY | a development key | Django's signing key (required in production) |
| STRIPE_API_KEY | sk_test_local | Stripe secret key |
| STRIPE_API_BASE | https://api.stripe.com | Stripe API address (localstripe in tests/demo) |
| STRIPE_WEBHOOK_SECRET | whsec_local | Stripe webhook signing secret |
| GPUSHARE_VAR_DIR | <repo>/var | local state: SQLite file, embedded broker, logs |
| GPUSHARE_METRICS_TOKEN | (none) | Bearer token for /metrics (docs/operations.md) |
| LOG_FORMAT / LOG_LEVEL | plain (json in production) / INFO | log lines (gpushare/observability/logs.py) |
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from agents.agent.brokerconf import PLATFORM_QUEUE, REPORT_QUEUE, broker_options
from gpushare.observability.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent.parent
VAR_DIR = Path(os.environ.get("GPUSHARE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


SECRET_KEY = os.environ.get("SECRET_KEY", "dev-insecure-gpushare-key-change-me")
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "axes",
    "accounts",
    "agents",
    "scheduler",
    "billing",
    "portal",
    "console",
    "endpoints",
    "webhooks",
    "admission",  # last: it provides the lower apps' ports in ready() and checks none is missing
]

MIDDLEWARE = [
    "gpushare.after_response.AfterResponseMiddleware",  # kicks to workers wait for the response, not it for them
    "gpushare.observability.health.OpsEndpointsMiddleware",  # /healthz /readyz /metrics: before host checks
    "gpushare.observability.middleware.RequestContextMiddleware",  # + the web's Prometheus series
    "django.middleware.security.SecurityMiddleware",
    "gpushare.csp.CachedCSPMiddleware",  # django-csp, its plain headers built once
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "gpushare.api.ApiBodyLimitMiddleware",
    "gpushare.api_edges.ApiExceptionMiddleware",
    "axes.middleware.AxesMiddleware",  # keep last: turns a locked-out login into the lockout page
]

# What an /api/ call made with a bearer token skips (gpushare/lanes.py): the browser's layers only.
BROWSER_ONLY_MIDDLEWARE = [
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "gpushare.urls"
CSRF_FAILURE_VIEW = "gpushare.api_edges.csrf_failure"  # the API's error shape on /api/ paths
WSGI_APPLICATION = "gpushare.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def conn_max_age(value: str | None) -> int | None:
    """``GPUSHARE_DB_CONN_MAX_AGE``: seconds a process keeps a database connection; unset or empty, for the
    process's life (``None``). Each thread's new connection costs the request that opens it ~15 ms (a server
    process forked, its caches cold, the prepared statements sent again): with a 60 s age every thread paid
    that once a minute, in the middle of someone's request (docs/benchmarks.md, session 28). A connection
    the server ended is still replaced before a request's first query (``CONN_HEALTH_CHECKS``)."""
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit():
        raise ImproperlyConfigured(
            f"GPUSHARE_DB_CONN_MAX_AGE={value!r}: whole seconds >= 0 (0: a connection per request), or empty"
            " to keep a connection for the process's life"
        )
    return int(value)


def database_from_url(url: str) -> dict:
    max_age = conn_max_age(os.environ.get("GPUSHARE_DB_CONN_MAX_AGE"))
    config = dj_database_url.parse(url, conn_max_age=max_age, conn_health_checks=True)
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # WAL lets the web server read while the worker writes; IMMEDIATE
        # transactions take the write lock up front instead of failing late.
        config["CONN_MAX_AGE"] = 0
        config["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    elif "postgresql" in config["ENGINE"]:
        config["ENGINE"] = "gpushare.db.postgresql"  # Django's, its health check without a round trip
        options = config.setdefault("OPTIONS", {})
        options.setdefault("connect_timeout", 5)  # an unreachable server fails fast
        # No JIT: the API's queries are short index scans whose estimates (subplans per row) can pass the
        # JIT threshold, and compiling them cost ~200 ms for a 1 ms job list page (docs/benchmarks.md, #19).
        # Generic plans for the statements prepared on the server (gpushare.prepared.ServerStatement): by
        # default PostgreSQL plans each of the first five runs on a connection again for its values, and a
        # connection per thread, kept for the process's life, met a rarely sent statement (an array submit's)
        # in that phase at nearly every call: 1.2-1.4 ms for its EXECUTE against 0.6 ms with the plan kept
        # (docs/benchmarks.md, session 29). Queries Django sends as text are planned each time either way.
        options.setdefault("options", "-c jit=off -c plan_cache_mode=force_generic_plan")
    return config


DATABASE_URL = os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'gpushare.sqlite3'}")
DATABASES = {"default": database_from_url(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 8}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []

# Web logins go through django-axes (brute-force lockout) before the model backend.
AUTHENTICATION_BACKENDS = ["accounts.backends.LoginLockoutBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = int(os.environ.get("GPUSHARE_LOGIN_FAILURE_LIMIT", "5"))
AXES_COOLOFF_TIME = float(os.environ.get("GPUSHARE_LOGIN_COOLOFF_HOURS", "0.25"))  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "gpushare <noreply@gpushare.local>")

# --- REST API -------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "gpushare.throttling.BearerTokenAuthentication",  # + rate limits in one round trip
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "gpushare.api.Pagination",
    # DRF's negotiation, its answers remembered per renderer classes, format and Accept header.
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "gpushare.negotiation.RememberingContentNegotiation",
    # DRF's JSON written by orjson (gpushare/renderers.py); the browsable API for people.
    "DEFAULT_RENDERER_CLASSES": [
        "gpushare.renderers.FastJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "gpushare.schema.PublicAutoSchema",
    "EXCEPTION_HANDLER": "gpushare.api.exception_handler",
    # Per token (GPUSHARE_API_RATE) and per tenant (its plan's api_requests_per_minute), both in Redis.
    "DEFAULT_THROTTLE_CLASSES": ["gpushare.throttling.TokenRateThrottle", "gpushare.throttling.TenantRateThrottle"],
    "DEFAULT_PARSER_CLASSES": [
        "gpushare.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "token": os.environ.get("GPUSHARE_API_RATE", "600/min"),
        # Unset: each tenant's plan limit api_requests_per_minute. Set (benchmarks): one rate for every tenant.
        "tenant": os.environ.get("GPUSHARE_TENANT_API_RATE") or None,
    },
    "UNAUTHENTICATED_USER": None,
}
# Request bodies over this are refused (413 on /api/; see gpushare.api.ApiBodyLimitMiddleware).
DATA_UPLOAD_MAX_MEMORY_SIZE = 1 << 20
# The API's rate-limit counters: shared through Redis when there is one.
CACHES = {
    "default": (
        {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": os.environ["REDIS_URL"]}
        if os.environ.get("REDIS_URL")
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}
SPECTACULAR_SETTINGS = {
    "TITLE": "gpushare API",
    "DESCRIPTION": "Submit GPU jobs, follow them, and read usage and invoices.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # /api/docs/ works offline: Redoc and Swagger UI are served from our own static files.
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "gpushare.api.error_responses_hook"],
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "scheduler.models.JobState",
        "InvoiceStateEnum": "billing.models.Invoice.State",
    },
}

# --- Celery ---------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "")
_broker = os.environ.get("CELERY_BROKER_URL") or REDIS_URL or "filesystem://"
CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS = broker_options(_broker, VAR_DIR)
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_DEFAULT_QUEUE = PLATFORM_QUEUE
# Node reports (agents.agent.protocol): consumed by every worker through its report gate; its depth is exported too.
GPUSHARE_EXTRA_QUEUES = (REPORT_QUEUE,)
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
# Below the Redis visibility timeout (agents/agent/brokerconf.py, 120 s), so a
# task is never delivered twice while it still runs; longer tasks say so.
CELERY_TASK_TIME_LIMIT = 110
CELERY_TASK_SOFT_TIME_LIMIT = 100
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's default scheduler, noting each tick for beat's readiness probe.
CELERY_BEAT_SCHEDULER = "gpushare.observability.worker:HeartbeatScheduler"
CELERY_BEAT_SCHEDULE = {
    "scheduler-pass": {"task": "scheduler.pass", "schedule": 5.0},
    "agents-check-nodes": {"task": "agents.check_nodes", "schedule": 5.0},
    "admission-budgets-enforce": {"task": "admission.budgets_enforce", "schedule": 60.0},
    "billing-close-month": {"task": "billing.close_month", "schedule": 3600.0},
    "billing-dunning-check": {"task": "billing.dunning_check", "schedule": 3600.0},
    "endpoints-autoscale": {"task": "endpoints.autoscale", "schedule": 2.0},
    "scheduler-launches-resend": {"task": "scheduler.launches_resend", "schedule": 15.0},
    "endpoints-minutes-prune": {"task": "endpoints.minutes_prune", "schedule": 3600.0},
    "webhooks-deliveries-due": {"task": "webhooks.deliveries_due", "schedule": 5.0},
}

# --- gpushare -------------------------------------------------------------
GPUSHARE = {
    # The endpoint gateway's public address, shown to tenants as where to send requests (blank: path only).
    "GATEWAY_URL": os.environ.get("GPUSHARE_GATEWAY_URL", ""),
    # Where the endpoint gateway reaches a node's replicas: {"node-name": "10.0.0.5", ...}; default 127.0.0.1.
    "NODE_ADDRESSES": dict(
        pair.split("=", 1) for pair in os.environ.get("GPUSHARE_NODE_ADDRESSES", "").split(",") if "=" in pair
    ),
    # A node is marked down after this many heartbeat intervals without news.
    "HEARTBEAT_INTERVAL_S": int(os.environ.get("GPUSHARE_HEARTBEAT_INTERVAL_S", "5")),
    "MISSED_HEARTBEATS_DOWN": int(os.environ.get("GPUSHARE_MISSED_HEARTBEATS_DOWN", "3")),
    # What happens to the jobs of a node that went down: "requeue" or "fail".
    "LOST_JOB_POLICY": os.environ.get("GPUSHARE_LOST_JOB_POLICY", "requeue"),
    "DEFAULT_MAX_RUNTIME_S": int(os.environ.get("GPUSHARE_DEFAULT_MAX_RUNTIME_S", str(24 * 3600))),
    # An endpoint's money hold: its max replicas for this long at its price (docs/accounts.md, "Money holds").
    "ENDPOINT_HOLD_HORIZON_S": int(os.environ.get("GPUSHARE_ENDPOINT_HOLD_HORIZON_S", str(24 * 3600))),
    "STOP_GRACE_S": int(os.environ.get("GPUSHARE_STOP_GRACE_S", "30")),
    # Bearer token Prometheus sends to /metrics (web, gateway, worker, beat, agent); blank: metrics off
    # except on a DEBUG server's loopback (and the worker/beat/agent ports, which bind 127.0.0.1).
    "METRICS_TOKEN": os.environ.get("GPUSHARE_METRICS_TOKEN", ""),
    # Webhooks reach public addresses only, and these networks (CIDRs, comma-separated) the operator allows.
    "WEBHOOK_ALLOWED_NETWORKS": os.environ.get("GPUSHARE_WEBHOOK_ALLOWED_NETWORKS", ""),
    # The node link (docs/operator-guide.md, "Trust model"): where the platform's Ed25519 command-signing
    # keys live (manage.py nodelink_keygen), how long a signed command stays valid, the clock skew allowed
    # between platform and nodes (commands and usage windows), and whether a missing key is created on first
    # use (dev and tests; production refuses to send unsigned and says to run nodelink_keygen).
    "NODELINK_KEY_DIR": os.environ.get("GPUSHARE_NODELINK_KEY_DIR", str(VAR_DIR / "nodelink")),
    "NODELINK_COMMAND_TTL_S": int(os.environ.get("GPUSHARE_NODELINK_COMMAND_TTL_S", "600")),
    "NODELINK_CLOCK_SKEW_MS": int(os.environ.get("GPUSHARE_NODELINK_CLOCK_SKEW_MS", "15000")),
    "NODELINK_AUTO_KEY": env_bool("GPUSHARE_NODELINK_AUTO_KEY", True),
    # Statements on the submit path are planned once per database connection (PREPARE / EXECUTE,
    # gpushare.prepared.ServerStatement). Off behind a pooler that hands one client's statements to
    # several server sessions (PgBouncer in transaction mode): GPUSHARE_DB_SERVER_PREPARED=0.
    "DB_SERVER_PREPARED": env_bool("GPUSHARE_DB_SERVER_PREPARED", True),
    # Job list pages each web process keeps while nothing on them changes (scheduler/api/page_selectors.py):
    # at most this many bytes of them (least recently used out first); 0: none kept.
    "LIST_CACHE_BYTES": int(os.environ.get("GPUSHARE_LIST_CACHE_MB", "32")) << 20,
    # Registries image jobs may pull from (comma-separated, e.g. "nvcr.io,ghcr.io"); empty: any.
    "ALLOWED_REGISTRIES": tuple(
        r.strip().lower() for r in os.environ.get("GPUSHARE_ALLOWED_REGISTRIES", "").split(",") if r.strip()
    ),
}

STRIPE_API_KEY = os.environ.get("STRIPE_API_KEY", "sk_test_local")
STRIPE_API_BASE = os.environ.get("STRIPE_API_BASE", "https://api.stripe.com")
STRIPE_WEBHOOK_SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "whsec_local")
# Set STRIPE_LOCALSTRIPE=1 when STRIPE_API_BASE points at localstripe (billing/gateway.py says why).
STRIPE_LOCALSTRIPE = env_bool("STRIPE_LOCALSTRIPE", False)

# Human lines by default; LOG_FORMAT=json (production's default) for one JSON object a line
# with request id, tenant, job and node where known (gpushare/observability/logs.py).
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain")
LOGGING = logging_config(
    fmt=LOG_FORMAT,
    level=os.environ.get("LOG_LEVEL", "INFO"),
    periodic_tasks=[entry["task"] for entry in CELERY_BEAT_SCHEDULE.values()],
)

# --- Content security policy (django-csp) ------------------------------------------
# Scripts, styles, images and connections only from our own origin: no inline
# script, no eval, no framing, forms post only here. Inline style *attributes*
# are allowed (style-src-attr): the portal sets meter widths and a few margins
# with them, and they cannot run code; <style> elements stay forbidden. The API
# docs (Redoc, Swagger UI) relax this on their own pages (gpushare/urls.py).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "style-src-attr": ["'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}
