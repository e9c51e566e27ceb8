"""A job array on the real platform: HTTP API, a Celery worker process, an agent process on
simulated GPUs. Each task sees its own $GPUSHARE_ARRAY_INDEX and is metered and billed on its own."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django_scopes import scopes_disabled

from billing.models import UsageWindow
from scheduler.models import Job, JobLogChunk, JobState
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration


def test_array_tasks_run_with_their_index_and_are_billed_per_task(platform, agent_factory):
    agent_factory("node-a", gpus="sim:1xH100-80GB")
    tenant = TenantFactory(slug="sweep")
    session = platform.session_for(tenant)
    command = ["sh", "-c", 'echo "index=$GPUSHARE_ARRAY_INDEX of $GPUSHARE_ARRAY_COUNT in $GPUSHARE_ARRAY_ID"; sleep 1']
    body = {"kind": "inference", "gpus": 0.25, "command": command, "array": {"range": "3-9:3"}}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=15)
    assert response.status_code == 201, response.text
    array = response.json()

    def done():
        states = session.get(f"{platform.url}/api/v1/arrays/{array['id']}/", timeout=10).json()["states"]
        return states == {"succeeded": 3} and states

    wait_for(done, timeout=90, what="the array's three tasks to succeed")
    with scopes_disabled():
        tasks = list(Job.objects.filter(array_id=array["id"]).order_by("array_index"))
        assert [t.state for t in tasks] == [JobState.SUCCEEDED] * 3
        for task in tasks:
            log = b"".join(bytes(c.data) for c in JobLogChunk.objects.filter(job=task).order_by("offset"))
            assert f"index={task.array_index} of 3 in {array['id']}".encode() in log

    # Billed per task: each task's cost is the sum of its own usage windows, and every task has some.
    def has_last_window(t) -> bool:
        with scopes_disabled():
            return UsageWindow.objects.filter(
                job_id=t.pk, end_ms__gte=int(t.finished_at.timestamp() * 1000) - 1
            ).exists()

    for task in tasks:
        wait_for(
            lambda t=task: has_last_window(t),
            timeout=30,
            what=f"task {task.array_index}'s last window",
        )
    with scopes_disabled():
        for task in Job.objects.filter(array_id=array["id"]):
            windows = list(UsageWindow.objects.filter(job=task))
            assert windows, f"task {task.array_index} has no usage windows"
            assert {w.tenant_id for w in windows} == {tenant.pk}
            assert task.cost == sum((w.amount for w in windows), Decimal(0)) and task.cost > 0
            assert task.gpu_ms == sum(w.gpu_ms for w in windows)
    listed = session.get(f"{platform.url}/api/v1/jobs/?array={array['id']}", timeout=10).json()["results"]
    assert sorted(j["array"]["index"] for j in listed) == [3, 6, 9]
    assert all(Decimal(j["cost"]) > 0 for j in listed)
