"""Money holds: admission reserves a job's (or an endpoint's) max cost against what the budget has left."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import close_old_connections, connection
from django_scopes import scopes_disabled

from accounts.services import quota_set
from admission import selectors
from endpoints.services import EndpointError, EndpointSpec, endpoint_create, endpoint_delete
from scheduler.models import Job, JobState
from scheduler.services import JobError, JobSpec, job_cancel, job_submit
from tests.accounts.helpers import usage_add
from tests.api.helpers import assert_error
from tests.factories import TenantFactory, platform_rules_seed

HOUR = 3600


def hold_of(*, gpus: int = 1, seconds: int = HOUR) -> Decimal:
    """The hold admission takes for a training job on ``gpus`` whole GPUs (the dearest model, its class)."""
    from scheduler.services import priority_for

    priority = priority_for(kind="training")
    return selectors.job_hold(
        selectors.prices_now(),
        mode="dedicated",
        gpu_model="",
        gpu_milli=gpus * 1000,
        max_runtime_s=seconds,
        multiplier=priority.price_multiplier,
    )


def spec(*, gpus: int = 1, seconds: int = HOUR) -> JobSpec:
    return JobSpec(kind="training", gpu_milli=gpus * 1000, command=["true"], max_runtime_s=seconds)


def held_and_spent(tenant) -> tuple[Decimal, Decimal]:
    return selectors.holds_open(tenant), selectors.month_usage(tenant).spend


def test_a_job_that_can_cost_more_than_is_left_is_refused_with_the_numbers(rules, tenant):
    """A tenant at 99% of $1,000 cannot start 8 GPUs for 24 hours (the issue's example)."""
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("1000.00"))
    job = job_submit(tenant=tenant, user=None, spec=spec(seconds=60))
    usage_add(tenant, amount="990.00", job=job)  # 99% spent
    with pytest.raises(JobError) as refused:
        job_submit(tenant=tenant, user=None, spec=spec(gpus=8, seconds=24 * HOUR))
    cost = hold_of(gpus=8, seconds=24 * HOUR)
    assert refused.value.code == "budget_exceeded"
    message = str(refused.value)
    assert f"this job can cost up to ${cost:,.2f}" in message
    assert "of your $1,000.00 budget is left" in message and "monthly_spend_limit" in message
    # A job that fits in the $10 left (less the first job's small open hold) is admitted.
    job_submit(tenant=tenant, user=None, spec=spec(seconds=HOUR))


def test_the_api_answers_403_stating_the_hold_and_what_is_left(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("50.00"))
    body = {"kind": "training", "gpus": 8, "command": ["true"], "max_runtime_seconds": 86400}
    response = api_client_for(tenant).post("/api/v1/jobs/", body, format="json")
    error = assert_error(response, 403, "budget_exceeded")
    assert f"can cost up to ${hold_of(gpus=8, seconds=86400):,.2f}" in error["message"]
    assert "$50.00 of your $50.00 budget is left" in error["message"]


def test_the_hold_shrinks_as_usage_is_metered_and_is_released_when_the_job_ends(rules, tenant):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100.00"))
    job = job_submit(tenant=tenant, user=None, spec=spec(gpus=2, seconds=HOUR))
    full = hold_of(gpus=2, seconds=HOUR)
    assert held_and_spent(tenant) == (full, Decimal(0))
    usage_add(tenant, amount="1.50", job=job)
    held, spent = held_and_spent(tenant)
    assert held == full - Decimal("1.50") and spent == Decimal("1.50")  # held + spent stays the job's max cost
    status = selectors.budget_status(tenant)
    assert status.held == held and status.budget_left == Decimal("100.00") - spent - held
    with scopes_disabled():
        job_cancel(job=job)
    assert held_and_spent(tenant) == (Decimal(0), Decimal("1.50"))


def test_an_endpoint_holds_its_max_replicas_for_the_billing_horizon(rules, tenant, settings):
    settings.GPUSHARE = {**settings.GPUSHARE, "ENDPOINT_HOLD_HORIZON_S": 3600}
    prices = selectors.prices_now()
    per_replica = selectors.endpoint_hold(
        prices, gpu_milli=250, gpu_model="", max_replicas=1, multiplier=selectors._multiplier("")
    )
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=(per_replica * 3).quantize(Decimal("0.01")))
    with scopes_disabled():
        endpoint = endpoint_create(
            tenant=tenant, user=None, spec=EndpointSpec(name="a", command=["x"], gpu_milli=250, max_replicas=2)
        )
        assert selectors.holds_open(tenant) == per_replica * 2
        with pytest.raises(EndpointError) as refused:
            endpoint_create(
                tenant=tenant, user=None, spec=EndpointSpec(name="b", command=["x"], gpu_milli=250, max_replicas=2)
            )
        assert refused.value.code == "budget_exceeded" and "this endpoint (2 replicas for 1 h)" in str(refused.value)
        endpoint_delete(endpoint=endpoint, user=None)
        assert selectors.holds_open(tenant) == 0
        endpoint_create(
            tenant=tenant, user=None, spec=EndpointSpec(name="b", command=["x"], gpu_milli=250, max_replicas=2)
        )


@pytest.mark.django_db(transaction=True)
def test_concurrent_submits_never_hold_more_than_the_budget():
    """100 submits at once against a budget with room for 10 holds: exactly 10 are admitted, and
    held + spent never passes the budget at any sample taken while they race."""
    platform_rules_seed()
    tenant = TenantFactory(slug="hold-race")
    first = job_submit(tenant=tenant, user=None, spec=spec(seconds=60))
    with scopes_disabled():
        Job.objects.filter(pk=first.pk).update(state=JobState.SUCCEEDED)  # finished: it holds nothing
    usage_add(tenant, amount="7.00", job=first)
    hold = hold_of()
    budget = Decimal("7.00") + hold * 10 + hold / 2  # room for exactly 10 more holds
    budget = budget.quantize(Decimal("0.01"))
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=budget)

    submits, threads_n = 100, 40  # 40 connections (the shared server allows 100 in all)
    start = threading.Barrier(threads_n + 1)
    done = threading.Event()
    admitted, refused, errors, samples = [], [], [], []
    todo = list(range(submits))
    lock = threading.Lock()

    def submitter():
        start.wait()
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    todo.pop()
                try:
                    admitted.append(job_submit(tenant=tenant, user=None, spec=spec()).pk)
                except JobError as exc:
                    refused.append(exc.code)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(repr(exc))
        finally:
            connection.close()

    def sampler():
        start.wait()
        try:
            while not done.is_set():
                held, spent = held_and_spent(tenant)
                samples.append(held + spent)
        finally:
            connection.close()

    workers = [threading.Thread(target=submitter) for _ in range(threads_n)]
    watcher = threading.Thread(target=sampler)
    for t in [*workers, watcher]:
        t.start()
    for t in workers:
        t.join(120)
    done.set()
    watcher.join(30)
    close_old_connections()

    assert errors == []
    assert len(admitted) == 10 and len(refused) == 90
    assert set(refused) == {"budget_exceeded"}
    assert samples and max(samples) <= budget, (max(samples), budget)
    held, spent = held_and_spent(tenant)
    assert held == hold * 10 and held + spent <= budget
