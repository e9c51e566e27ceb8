"""`GET estimate/` and `gpushare estimate` show what a submission would hold against the budget."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.services import quota_set
from admission import selectors
from scheduler.services import priority_for
from tests.cli.test_cli import run_cli
from tests.factories import TenantFactory, platform_rules_seed, token_for


def hold_for(*, gpus: int, seconds: int) -> Decimal:
    return selectors.job_hold(
        selectors.prices_now(),
        mode="dedicated",
        gpu_model="",
        gpu_milli=gpus * 1000,
        max_runtime_s=seconds,
        multiplier=priority_for(kind="training").price_multiplier,
    )


@pytest.mark.django_db
def test_the_estimate_api_states_the_hold_and_the_budget_left(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("20.00"))
    client = api_client_for(tenant)
    body = client.get("/api/v1/estimate/", {"gpus": 1, "max_runtime_seconds": 3600, "kind": "training"}).json()
    assert body["hold"] == {
        "amount": str(hold_for(gpus=1, seconds=3600)),
        "limit": "20.00",
        "held": "0.00",
        "left": "20.00",
        "fits": True,
    }
    big = client.get("/api/v1/estimate/", {"gpus": 8, "max_runtime_seconds": 86400, "kind": "training"}).json()
    assert big["hold"]["fits"] is False


def test_gpushare_estimate_prints_the_hold(live_server, transactional_db, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}
    platform_rules_seed()
    tenant = TenantFactory(slug="estimator")
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100.00"))
    token = token_for(tenant)
    out = run_cli(live_server.url, token, "estimate", "--gpus", "2", "--max-runtime-seconds", "3600")
    assert out.returncode == 0, out.stderr
    amount = hold_for(gpus=2, seconds=3600)
    assert "HOLD" in out.stdout
    assert f"submitting holds ${amount}; $100.00 of your $100.00 budget is left" in out.stdout
    out = run_cli(live_server.url, token, "estimate", "--gpus", "8", "--max-runtime-seconds", "86400")
    assert "this job does not fit: it would be refused (403 budget_exceeded)" in out.stdout
