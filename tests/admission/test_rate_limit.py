"""API requests per tenant per minute, counted across every web process through Redis."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import requests

from accounts.services import quota_set
from tests.factories import TenantFactory, platform_rules_seed, token_for
from tests.processes import _spawn, _stop, process_env


def _web_server(env: dict):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "gpushare.serve", "--bind", f"127.0.0.1:{port}", "--workers", "1", "--threads", "2"]
    proc, log_path = _spawn(f"web-rate-{port}", argv, env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-2000:]) from None
            time.sleep(0.2)
    _stop(proc)
    raise RuntimeError("the web server did not start")


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_two_tokens_on_two_web_processes_share_the_tenants_allowance():
    platform_rules_seed()
    tenant = TenantFactory(slug="rate-a")
    other = TenantFactory(slug="rate-b")
    quota_set(tenant=tenant, actor=None, api_requests_per_minute=20)
    from accounts.principal_cache import _redis

    _redis().delete(f"throttle:tenant:{tenant.pk}")  # a run within the minute before had a tenant of this id
    tokens = [token_for(tenant), token_for(tenant)]
    env = process_env({"GPUSHARE_API_RATE": "100000/min"})  # the per-token limit is out of the way
    servers = [_web_server(env), _web_server(env)]
    try:
        statuses = []
        for i in range(40):  # alternate processes and tokens: 10 requests for each pair
            _, port = servers[i % 2]
            response = requests.get(
                f"http://127.0.0.1:{port}/api/v1/jobs/",
                headers={"Authorization": f"Bearer {tokens[(i // 2) % 2]}"},
                timeout=30,
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                last_refusal = response
        allowed = statuses.count(200)
        # GCRA: 20 at once, then one every 3 s; the 40 requests take well under 3 s per extra one.
        assert 20 <= allowed <= 21, statuses
        assert statuses.count(429) == 40 - allowed
        error = last_refusal.json()["error"]
        assert error["code"] == "rate_limited"
        assert "api_requests_per_minute=20" in error["message"] and "tenant" in error["message"]
        assert int(last_refusal.headers["Retry-After"]) >= 1
        # Another tenant has its own allowance.
        _, port = servers[0]
        response = requests.get(
            f"http://127.0.0.1:{port}/api/v1/jobs/",
            headers={"Authorization": f"Bearer {token_for(other)}"},
            timeout=30,
        )
        assert response.status_code == 200
    finally:
        for proc, _ in servers:
            _stop(proc)


@pytest.mark.django_db
@pytest.mark.parametrize("counted_in", ["redis", "local memory"])
def test_two_tokens_of_one_tenant_share_its_allowance_in_process(
    rules, tenant, other_tenant, api_client_for, settings, counted_in
):
    """Each request spends one unit: in Redis the token check counts it (one round trip with the
    token's version, once its principal is cached), without Redis DRF's history does."""
    from tests.api.helpers import assert_error

    if counted_in == "redis":
        settings.CACHES = {
            "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": settings.REDIS_URL}
        }
        from accounts.principal_cache import _redis

        _redis().delete(f"throttle:tenant:{tenant.pk}")  # an earlier run's tenant of the same id

    quota_set(tenant=tenant, actor=None, api_requests_per_minute=3)
    first, second = api_client_for(tenant), api_client_for(tenant)
    assert [c.get("/api/v1/jobs/").status_code for c in (first, second, first)] == [200, 200, 200]
    error = assert_error(second.get("/api/v1/jobs/"), 429, "rate_limited")
    assert "limit api_requests_per_minute=3" in error["message"]
    assert api_client_for(other_tenant).get("/api/v1/jobs/").status_code == 200


@pytest.mark.django_db
def test_one_platform_rate_can_replace_every_tenants_limit(rules, tenant, api_client_for, settings):
    """GPUSHARE_TENANT_API_RATE (what make bench sets) overrides the plan limits."""
    rates = {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "tenant": "100000/min"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}
    quota_set(tenant=tenant, actor=None, api_requests_per_minute=1)
    client = api_client_for(tenant)
    assert [client.get("/api/v1/jobs/").status_code for _ in range(3)] == [200, 200, 200]
