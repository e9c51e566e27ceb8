"""Liveness and readiness of the web app, and the checks other processes share.

``/healthz``: the process answers (liveness; nothing else is asked).
``/readyz``: the database, the broker and the cache answer, each within
``CHECK_TIMEOUT_S`` (readiness: 503 with what failed, so a load balancer or
Kubernetes stops sending traffic until they are back).
``/metrics``: Prometheus, behind ``GPUSHARE_METRICS_TOKEN`` (``Authorization:
Bearer <token>``); without a token only a DEBUG (development) server answers
it, and then only to loopback clients.

The three are answered by ``OpsEndpointsMiddleware``, first in MIDDLEWARE:
before host validation (a kubelet probes the pod's IP), the HTTPS redirect
(probes speak plain HTTP inside the cluster), sessions and the request
metrics (a probe every few seconds is not traffic).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.http import HttpResponse, JsonResponse

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 3.0
# /readyz is open to anyone who reaches the port: one round of checks per process per
# second at most, however often it is asked (a flood cannot turn into database connections).
READY_CACHE_S = 1.0
_ready_lock = threading.Lock()
_ready_cache: tuple[float, dict[str, str]] | None = None
OPS_PATHS = ("/healthz", "/readyz", "/metrics")


def database_check() -> None:
    """SELECT 1 on a connection of this thread (closed afterwards: a check thread is short-lived)."""
    from django.db import connections

    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()


def broker_check() -> None:
    """Connect to the broker Celery uses (a plain kombu connection: no Celery app to load)."""
    from kombu import Connection

    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    with Connection(settings.CELERY_BROKER_URL, transport_options=options, connect_timeout=CHECK_TIMEOUT_S) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=CHECK_TIMEOUT_S)
        client = getattr(conn.default_channel, "client", None)
        if client is not None and hasattr(client, "ping"):
            client.ping()  # Redis: a round trip, not only a socket


def cache_check() -> None:
    from django.core.cache import cache

    key = "gpushare:readyz"
    value = str(time.time())
    cache.set(key, value, 30)
    if cache.get(key) != value:
        raise RuntimeError("the cache did not return what was just stored")


CHECKS: dict[str, Callable[[], None]] = {"database": database_check, "broker": broker_check, "cache": cache_check}


def checks_run(names=None, *, timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, str]:
    """Run checks in parallel threads, each bounded by ``timeout_s``: ``{name: "ok" | why it failed}``."""
    results: dict[str, str] = {}
    threads = []
    for name in names or CHECKS:

        def run(name=name):
            try:
                CHECKS[name]()
                results[name] = "ok"
            except Exception as exc:  # noqa: BLE001 - whatever it is, the dependency is not usable
                results[name] = f"{type(exc).__name__}: {exc}"[:300]

        thread = threading.Thread(target=run, name=f"readyz-{name}", daemon=True)
        thread.start()
        threads.append((name, thread))
    deadline = time.monotonic() + timeout_s
    for name, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            results[name] = f"no answer within {timeout_s:.0f} s"
    return {name: results[name] for name, _ in threads}


def readiness() -> dict[str, str]:
    """The web's checks, reused for ``READY_CACHE_S``."""
    global _ready_cache
    with _ready_lock:
        if _ready_cache is not None and time.monotonic() - _ready_cache[0] < READY_CACHE_S:
            return _ready_cache[1]
        results = checks_run()
        _ready_cache = (time.monotonic(), results)
        return results


# --- /metrics access ---------------------------------------------------------------------


def metrics_token() -> str:
    return settings.GPUSHARE.get("METRICS_TOKEN", "")


def metrics_refusal(*, authorization: str, remote_addr: str) -> tuple[int, str] | None:
    """None when a scrape may read /metrics, else (status, why)."""
    token = metrics_token()
    if token:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return None
        return 401, "send 'Authorization: Bearer <GPUSHARE_METRICS_TOKEN>'"
    if settings.DEBUG and _loopback(remote_addr):
        return None
    return 403, "metrics are off: set GPUSHARE_METRICS_TOKEN and scrape with it"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# --- the middleware -------------------------------------------------------------------------


class OpsEndpointsMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path not in OPS_PATHS or request.method not in ("GET", "HEAD"):
            return self.get_response(request)
        if request.path == "/healthz":
            return JsonResponse({"ok": True})
        if request.path == "/readyz":
            results = readiness()
            ready = all(v == "ok" for v in results.values())
            if not ready:
                log.warning("not ready: %s", json.dumps({k: v for k, v in results.items() if v != "ok"}))
            return JsonResponse({"ready": ready, "checks": results}, status=200 if ready else 503)
        refusal = metrics_refusal(
            authorization=request.META.get("HTTP_AUTHORIZATION", ""), remote_addr=request.META.get("REMOTE_ADDR", "")
        )
        if refusal is not None:
            code = "unauthenticated" if refusal[0] == 401 else "forbidden"
            return JsonResponse({"error": {"code": code, "message": refusal[1], "fields": {}}}, status=refusal[0])
        from prometheus_client import CONTENT_TYPE_LATEST

        from .metrics import scrape

        return HttpResponse(scrape(queue_depth=False), content_type=CONTENT_TYPE_LATEST)
