"""GET quota/: limits, what the tenant holds now, the headroom and the month."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django_scopes import scopes_disabled

from accounts.services import quota_set
from scheduler.models import Allocation, Job, JobState
from tests.factories import UserFactory

from .helpers import assert_error, job_make, node_make

pytestmark = pytest.mark.django_db


def test_no_limits(rules, tenant, api_client_for):
    body = api_client_for(tenant).get("/api/v1/quota/").json()
    assert body["limits"]["max_dedicated_gpus"] is None
    assert body["headroom"]["dedicated_gpus"] is None
    assert body["current"] == {"dedicated_gpus": 0, "shared_gpus": 0, "open_jobs": 0, "queued_jobs": 0, "endpoints": 0}
    assert body["month"]["exhausted"] is False


def test_limits_use_and_headroom(rules, tenant, other_tenant, api_client_for):
    quota_set(
        tenant=tenant,
        actor=UserFactory(is_staff=True),
        max_dedicated_gpus=4,
        max_shared_milli=1000,
        max_open_jobs=5,
        monthly_spend_limit=Decimal("100.00"),
    )
    node = node_make(gpus=3)
    gpus = list(node.gpus.order_by("index"))
    # An hour's max runtime: each job's money hold fits the $100 budget.
    training = job_make(tenant, gpu_milli=2000, max_runtime_s=3600)
    serving = job_make(tenant, kind="inference", gpu_milli=250, max_runtime_s=3600)
    job_make(tenant, max_runtime_s=3600)  # queued, holds no GPU (but holds money)
    finished = job_make(tenant, max_runtime_s=3600)
    theirs = job_make(other_tenant, gpu_milli=1000)
    with scopes_disabled():
        Allocation.objects.bulk_create(
            [
                Allocation(tenant=tenant, job=training, gpu=gpus[0], share_milli=1000),
                Allocation(tenant=tenant, job=training, gpu=gpus[1], share_milli=1000),
                Allocation(tenant=tenant, job=serving, gpu=gpus[2], share_milli=250),
                Allocation(tenant=other_tenant, job=theirs, gpu=gpus[2], share_milli=500),
            ]
        )
        Job.objects.filter(pk__in=[training.pk, serving.pk]).update(state=JobState.RUNNING, node=node)
        Job.objects.filter(pk=finished.pk).update(state=JobState.SUCCEEDED)
    body = api_client_for(tenant).get("/api/v1/quota/").json()
    assert body["limits"]["max_dedicated_gpus"] == 4
    assert body["limits"]["max_shared_gpus"] == 1
    assert body["current"] == {
        "dedicated_gpus": 2,
        "shared_gpus": 0.25,
        "open_jobs": 3,
        "queued_jobs": 1,
        "endpoints": 0,
    }
    assert body["headroom"]["dedicated_gpus"] == 2
    assert body["headroom"]["shared_gpus"] == 0.75
    assert body["headroom"]["open_jobs"] == 2
    assert body["headroom"]["spend"] == "100.00"
    assert body["month"]["spend"] == "0.00"
    # Money held: the three unfinished jobs' max cost (the dearest model, an hour, their class multiplier).
    held = Decimal(body["month"]["held"])
    assert held > 0 and Decimal(body["month"]["budget_left"]) == Decimal("100.00") - held


def test_quota_needs_a_token_with_usage_scope(rules, tenant, api_client_for, client):
    assert_error(api_client_for(tenant, scopes=["jobs:read"]).get("/api/v1/quota/"), 403, "forbidden")
    assert_error(client.get("/api/v1/quota/"), 401, "unauthenticated")
