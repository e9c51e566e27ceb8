"""Budget and suspension stop RUNNING jobs for real: worker + agent processes, PostgreSQL, Redis."""

from __future__ import annotations

import sys
from decimal import Decimal

import pytest
from django_scopes import scopes_disabled

from accounts.models import Role
from accounts.services import quota_set, tenant_suspend
from admission.selectors import month_usage
from admission.tasks import budgets_enforce_task
from scheduler.models import Job
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

LONG = {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", "import time; time.sleep(120)"]}


def _running(platform, session) -> dict:
    response = session.post(f"{platform.url}/api/v1/jobs/", json=LONG, timeout=30)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    return wait_for(
        lambda: (
            (b := session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=30).json())["state"] == "running" and b
        ),
        timeout=60,
        what="the job to run",
    )


def _ended(platform, session, job_id: int) -> dict:
    return wait_for(
        lambda: (
            (b := session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=30).json())["state"]
            in ("cancelled", "failed", "succeeded")
            and b
        ),
        timeout=60,
        what="the job to end",
    )


def test_exhausted_budget_stops_the_running_job_and_refuses_new_ones(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="thrifty")
    # 0.001 GPU-hours: used up after 3.6 s on one GPU.
    quota_set(tenant=tenant, actor=None, gpu_hours_per_month=Decimal("0.001"), on_budget_exhausted="stop")
    session = platform.session_for(tenant, role=Role.MEMBER)
    job = _running(platform, session)
    wait_for(lambda: month_usage(tenant).gpu_ms >= 3600, timeout=60, what="the GPU-hours to reach the limit")

    budgets_enforce_task.delay()  # what beat sends every minute, run by the real worker

    ended = _ended(platform, session, job["id"])
    assert ended["state"] == "cancelled", ended
    assert "GPU-hours are used up" in ended["stop_reason"]
    refused = session.post(f"{platform.url}/api/v1/jobs/", json=LONG, timeout=30)
    assert refused.status_code in (402, 403, 409), refused.text
    assert refused.json()["error"]["code"] == "budget_exhausted"
    assert "gpu_hours_per_month=0.001" in refused.json()["error"]["message"]


def test_suspension_stops_the_running_job_reads_still_work(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="late-payer")
    session = platform.session_for(tenant, role=Role.OWNER)
    job = _running(platform, session)

    tenant_suspend(tenant=tenant, actor=None, reason="invoice unpaid after 3 attempts")

    ended = _ended(platform, session, job["id"])
    assert ended["state"] == "cancelled"
    assert ended["stop_reason"] == "tenant suspended: invoice unpaid after 3 attempts"
    refused = session.post(f"{platform.url}/api/v1/jobs/", json=LONG, timeout=30)
    assert refused.status_code == 403 and "suspended" in refused.json()["error"]["message"]
    assert session.get(f"{platform.url}/api/v1/jobs/", timeout=30).status_code == 200
    with scopes_disabled():
        assert Job.objects.get(pk=job["id"]).finished_at is not None
