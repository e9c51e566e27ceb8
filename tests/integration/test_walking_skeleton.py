"""One job crosses every component for real: HTTP API -> scheduler pass (Celery
worker) -> launch on the node's queue -> agent process -> usage windows ->
cost, all on PostgreSQL and Redis."""

from __future__ import annotations

import sys
from decimal import Decimal

import pytest
from django_scopes import scopes_disabled

from billing.models import UsageWindow
from billing.rating import window_amount
from scheduler.models import Job, JobState
from tests.factories import TenantFactory, price, wait_for

pytestmark = pytest.mark.integration

PRINT_GPU = "import os, time; print('visible=' + os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(1.5)"


def submit(platform, session, body: dict) -> dict:
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()


def wait_job(platform, session, job_id: int, states: set[str], timeout: float = 45) -> dict:
    def done():
        body = session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=10).json()
        return body if body["state"] in states else None

    return wait_for(done, timeout=timeout, what=f"job {job_id} to reach {states}")


def test_job_runs_pinned_metered_and_charged(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)

    created = submit(platform, session, {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", PRINT_GPU]})
    assert created["state"] == "queued"

    job = wait_job(platform, session, created["id"], {"succeeded", "failed"})
    assert job["state"] == "succeeded", job
    assert job["exit_code"] == 0
    assert job["node"] == "node-1"
    assert len(job["gpu_uuids"]) == 1 and job["gpu_uuids"][0].startswith("GPU-")

    logs = wait_for(
        lambda: (
            (body := session.get(f"{platform.url}/api/v1/jobs/{job['id']}/logs/", timeout=10).json())["data"] and body
        ),
        what="the job's log",
    )
    assert f"visible={job['gpu_uuids'][0]}" in logs["data"]
    assert logs["next_offset"] == len(logs["data"].encode())

    with scopes_disabled():
        stored = Job.objects.get(pk=job["id"])
        windows = list(UsageWindow.objects.filter(job=stored).order_by("seq"))
    assert windows, "the agent sent usage windows"
    assert [w.seq for w in windows] == list(range(len(windows)))
    # Windows tile the job's run exactly: no gap, no overlap.
    assert all(a.end_ms == b.start_ms for a, b in zip(windows, windows[1:], strict=False))
    held_ms = windows[-1].end_ms - windows[0].start_ms
    assert held_ms == round((stored.finished_at - stored.started_at).total_seconds() * 1000)
    assert held_ms >= 1500

    rate = price(windows[0].gpu_model, "dedicated")
    expected = sum(window_amount(gpu_ms=w.gpu_ms, per_gpu_hour=rate) for w in windows)
    assert stored.cost == expected
    assert abs(stored.cost - Decimal(held_ms) / 3_600_000 * rate) < Decimal("0.000001")
    assert Decimal(job["cost"]) == stored.cost  # the API shows money exact
    assert job["usage"]["gpu_seconds"] == pytest.approx(held_ms / 1000, abs=0.001)


def test_failing_command_ends_failed_with_its_exit_code(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    created = submit(
        platform, session, {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", "raise SystemExit(3)"]}
    )
    job = wait_job(platform, session, created["id"], {"succeeded", "failed"})
    assert job["state"] == JobState.FAILED
    assert job["exit_code"] == 3
