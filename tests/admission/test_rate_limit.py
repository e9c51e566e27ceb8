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

pytestmark = pytest.mark.integration


def _gunicorn(env: dict):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "gunicorn", "gpushare.wsgi", "-b", f"127.0.0.1:{port}", "-w", "1", "--threads", "2"]
    proc, log_path = _spawn(f"gunicorn-rate-{port}", argv, env)
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
    raise RuntimeError("gunicorn did not start")


@pytest.mark.django_db(transaction=True)
def test_two_tokens_on_two_web_processes_share_the_tenants_allowance():
    platform_rules_seed()
    tenant = TenantFactory(slug="rate-a")
    other = TenantFactory(slug="rate-b")
    quota_set(tenant=tenant, actor=None, api_requests_per_minute=20)
    tokens = [token_for(tenant), token_for(tenant)]
    env = process_env({"GPUSHARE_API_RATE": "100000/min"})  # the per-token limit is out of the way
    servers = [_gunicorn(env), _gunicorn(env)]
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
