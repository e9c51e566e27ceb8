"""A preview too large for the request runs in the real Celery worker; the page polls until the table is there."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django_scopes import scopes_disabled

from console import replay, whatif
from console.models import WhatIfRun
from console.rules import ruleset_from_data
from scheduler.models import Job, JobState, PriorityClass
from tests.console.conftest import node_with_gpus
from tests.console.test_rules import form_data
from tests.factories import TenantFactory, platform_rules_seed, wait_for

pytestmark = pytest.mark.integration


def recorded_jobs(now, tenants) -> None:
    """Twelve finished jobs of the last two hours, written as the scheduler would have left them."""
    classes = {c.name: c for c in PriorityClass.objects.all()}
    with scopes_disabled():
        for i in range(12):
            tenant = tenants[i % 2]
            submitted = now - timedelta(minutes=110 - 5 * i)
            job = Job.objects.create(
                tenant=tenant,
                kind="training",
                mode="dedicated",
                gpu_milli=1000,
                command=["true"],
                priority=classes["preemptible" if tenant.slug == "alpha" else "standard"],
                max_runtime_s=3600,
                state=JobState.SUCCEEDED,
                started_at=submitted + timedelta(minutes=1),
                finished_at=submitted + timedelta(minutes=21),
            )
            Job.objects.filter(pk=job.pk).update(submitted_at=submitted)


def test_a_large_preview_is_computed_by_the_worker_and_polled(transactional_db, celery_worker_process, monkeypatch):
    platform_rules_seed()
    PriorityClass.objects.get(name="standard").may_preempt.clear()
    node_with_gpus("solo", ("H100-80GB",))
    tenants = [TenantFactory(slug="alpha"), TenantFactory(slug="bravo")]
    now = timezone.now()
    recorded_jobs(now, tenants)
    operator = get_user_model().objects.create_user("ops@example.test", password="x" * 12, is_staff=True)
    client = Client()
    client.force_login(operator)
    monkeypatch.setattr(replay, "INLINE_REPLAY_JOBS", 5)  # twelve submissions: too many to replay inline

    response = client.post(
        reverse("console:rules"), {**form_data(**{"preemptible-rank": 250}), "hours": "3", "_preview": "1"}
    )
    run = response.context["run"]
    assert run is not None and response.context["comparison"] is None
    html = response.content.decode()
    assert f'hx-get="{reverse("console:whatif-run", args=[run.pk])}"' in html and 'hx-trigger="every 2s"' in html

    poll = reverse("console:whatif-run", args=[run.pk])
    wait_for(lambda: 'id="preview-table"' in client.get(poll).content.decode(), timeout=60, what="the worker's preview")
    run.refresh_from_db()
    assert run.state == WhatIfRun.State.DONE and run.created_by == operator
    # The worker's table is the one the request would have computed.
    expected = whatif.comparison_to_data(
        replay.preview_window(proposed=ruleset_from_data(run.draft), start=run.window_start, end=run.window_end)
    )
    assert run.result == expected
    alpha = next(r for r in run.result["rows"] if r["group"] == "tenant" and r["name"] == "alpha")
    assert alpha["after"]["mean_wait_s"] < alpha["before"]["mean_wait_s"]
    assert PriorityClass.objects.get(name="preemptible").rank == 100  # a preview never saves

    assert Client().get(poll).status_code == 302  # staff only
    assert client.get(reverse("console:whatif-run", args=[run.pk + 1000])).status_code == 404
