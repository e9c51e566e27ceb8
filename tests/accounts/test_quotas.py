"""Quota and budget admission, limits for the scheduler, budget enforcement."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.core import mail
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.limits import PLAN_DEFAULTS, Limits, MonthUsage, admission_refusal
from accounts.models import AuditLog, Plan, Role, RunningJobsPolicy, Tenant, TenantMonthUsage
from accounts.selectors import limits_for
from accounts.services import AccountsError, quota_set
from admission import services as admission_services
from admission.selectors import budget_status, month_bounds_ms, month_usage, month_usages
from admission.selectors import tenant_caps_for_scheduling as tenant_limits_for_scheduling
from admission.services import budgets_enforce, month_usage_advance
from billing.models import UsageWindow
from scheduler.models import Job, JobState
from scheduler.services import JobError, JobSpec, job_submit
from tests.accounts.helpers import job_make, submission_check, usage_add
from tests.factories import member_add

pytestmark = pytest.mark.django_db


def submit(tenant, *, gpu_milli=1000, kind="training"):
    return job_submit(tenant=tenant, user=None, spec=JobSpec(kind=kind, gpu_milli=gpu_milli, command=["true"]))


def refused(tenant, **kwargs) -> JobError:
    with pytest.raises(JobError) as exc:
        submit(tenant, **kwargs)
    return exc.value


def test_limits_come_from_quota_then_plan_then_default_plan(tenant):
    # No plan anywhere: the built-in plan defaults (counts, logs, API rate), no GPU or money limit.
    assert limits_for(tenant) == Limits(**PLAN_DEFAULTS)
    assert limits_for(tenant).max_gpus_per_job is None and limits_for(tenant).monthly_spend_limit is None
    Plan.objects.create(name="default", max_gpus_per_job=2, max_open_jobs=5, on_budget_exhausted="finish")
    team = Plan.objects.create(name="team", max_gpus_per_job=4)
    assert limits_for(tenant).max_gpus_per_job == 2
    quota_set(tenant=tenant, actor=None, plan=team)
    assert limits_for(tenant).max_gpus_per_job == 4
    assert limits_for(tenant).max_open_jobs == 5  # the plan leaves it empty: the default plan's
    quota_set(tenant=tenant, actor=None, max_gpus_per_job=1)
    assert limits_for(tenant).max_gpus_per_job == 1
    assert limits_for(tenant).on_budget_exhausted == RunningJobsPolicy.FINISH
    quota_set(tenant=tenant, actor=None, max_gpus_per_job=None)
    assert limits_for(tenant).max_gpus_per_job == 4


def test_quota_set_rejects_bad_values_and_is_audited(tenant):
    with pytest.raises(AccountsError, match="unknown quota field"):
        quota_set(tenant=tenant, actor=None, max_cats=1)
    with pytest.raises(AccountsError, match="on_budget_exhausted is one of"):
        quota_set(tenant=tenant, actor=None, on_budget_exhausted="explode")
    with pytest.raises(AccountsError, match="between 1 and 100"):
        quota_set(tenant=tenant, actor=None, budget_alert_percent=0)
    with pytest.raises(AccountsError, match="monthly_spend_limit: Ensure that there are no more than 2 decimal"):
        quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("0.001"))
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100.00"))
    entry = AuditLog.objects.get(tenant=tenant, action="quota.set")
    assert entry.before["monthly_spend_limit"] is None
    assert entry.after["monthly_spend_limit"] == "100.00"


@pytest.mark.parametrize(
    ("limits", "gpu_milli", "kind", "named"),
    [
        ({"max_gpus_per_job": 2}, 4000, "training", "max_gpus_per_job is 2"),
        ({"max_dedicated_gpus": 2}, 3000, "training", "max_dedicated_gpus (held at once) is 2"),
        ({"max_shared_milli": 250}, 500, "inference", "max_shared_capacity (held at once) is 0.25"),
    ],
)
def test_a_job_that_can_never_fit_is_refused(rules, tenant, limits, gpu_milli, kind, named):
    quota_set(tenant=tenant, actor=None, **limits)
    error = refused(tenant, gpu_milli=gpu_milli, kind=kind)
    assert error.code == "quota_exceeded"
    assert named in str(error)
    assert error.field == "gpus"
    with scopes_disabled():
        assert not Job.objects.filter(tenant=tenant).exists()


def test_a_job_within_the_limits_is_admitted(rules, tenant):
    quota_set(tenant=tenant, actor=None, max_gpus_per_job=2, max_dedicated_gpus=2, max_shared_milli=250)
    assert submit(tenant, gpu_milli=2000).state == JobState.QUEUED
    assert submit(tenant, gpu_milli=2000).state == JobState.QUEUED  # concurrency limits wait in the queue
    assert submit(tenant, gpu_milli=250, kind="inference").mode == "shared"


def test_open_jobs_limit_counts_unfinished_jobs_only(rules, tenant):
    quota_set(tenant=tenant, actor=None, max_open_jobs=2)
    first, _ = submit(tenant), submit(tenant)
    error = refused(tenant)
    assert error.code == "quota_exceeded" and "max_open_jobs is 2" in str(error)
    with scopes_disabled():
        Job.objects.filter(pk=first.pk).update(state=JobState.SUCCEEDED)
    assert submit(tenant).state == JobState.QUEUED


def test_gpu_hours_budget(rules, tenant, other_tenant):
    quota_set(tenant=tenant, actor=None, gpu_hours_per_month=Decimal("10"))
    job = submit(tenant)
    usage_add(tenant, gpu_hours=50, job=job, last_month=True)  # last month does not count
    usage_add(tenant, gpu_hours=Decimal("9.5"), job=job)
    assert month_usage(tenant).gpu_ms == int(Decimal("9.5") * 3_600_000)
    submit(tenant)
    usage_add(tenant, gpu_hours=Decimal("0.5"), job=job)
    error = refused(tenant)
    assert error.code == "budget_exhausted"
    assert "gpu_hours_per_month=10" in str(error)
    other_job = submit(other_tenant)  # another tenant is not affected
    usage_add(other_tenant, gpu_hours=100, job=other_job)
    submit(other_tenant)


def test_spend_budget_and_status(rules, tenant):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100.00"), budget_alert_percent=80)
    job = submit(tenant)
    usage_add(tenant, amount="79.99", job=job)
    status = budget_status(tenant)
    assert (status.alert, status.exhausted, status.spend_percent) == (False, False, Decimal("80.0"))
    usage_add(tenant, amount="0.01", job=job)
    assert budget_status(tenant).alert is True
    usage_add(tenant, amount="20.00", job=job)
    assert budget_status(tenant).exhausted is True
    error = refused(tenant)
    assert error.code == "budget_exhausted" and "monthly_spend_limit=100.00" in str(error)


def test_admission_rules_are_pure():
    limits = Limits(max_gpus_per_job=8, max_open_jobs=3, monthly_spend_limit=Decimal(10))
    assert admission_refusal(limits, MonthUsage(), open_jobs=2, mode="dedicated", gpu_milli=8000) is None
    assert admission_refusal(limits, MonthUsage(), open_jobs=3, mode="dedicated", gpu_milli=1000).code == (
        "quota_exceeded"
    )
    spent = MonthUsage(spend=Decimal(10))
    assert admission_refusal(limits, spent, open_jobs=0, mode="shared", gpu_milli=125).code == "budget_exhausted"


def test_limits_for_scheduling(rules, tenant, other_tenant):
    third = Tenant.objects.create(slug="tenant-c", name="C")
    quota_set(tenant=tenant, actor=None, max_dedicated_gpus=4, max_shared_milli=500)
    quota_set(tenant=other_tenant, actor=None, monthly_spend_limit=Decimal(1))
    usage_add(other_tenant, amount="1.00", job=job_make(other_tenant))
    Tenant.objects.filter(pk=third.pk).update(state=Tenant.State.SUSPENDED)

    limits = tenant_limits_for_scheduling()
    assert limits[tenant.pk].max_dedicated_gpus == 4 and limits[tenant.pk].max_shared_milli == 500
    assert limits[tenant.pk].blocked_reason == ""
    assert limits[other_tenant.pk].max_dedicated_gpus == 0
    assert "spend limit is reached" in limits[other_tenant.pk].blocked_reason
    assert limits[third.pk].blocked_reason == "the tenant is suspended"


def test_budgets_enforce_alerts_once_and_stops_running_jobs(
    rules, tenant, other_tenant, django_capture_on_commit_callbacks
):
    tenant.billing_email = "billing@tenant-a.test"
    tenant.save()
    owner = member_add(tenant, role=Role.OWNER)
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("10.00"), budget_alert_percent=50)
    running = job_make(tenant, owner, state=JobState.RUNNING)
    usage_add(tenant, amount="6.00", job=running)

    with django_capture_on_commit_callbacks(execute=True):
        assert budgets_enforce() == {"alerted": 1, "stopped": 0}
    assert [m.to for m in mail.outbox] == [["billing@tenant-a.test"]]
    assert "50% of its monthly budget" in mail.outbox[0].subject
    assert budgets_enforce() == {"alerted": 0, "stopped": 0}  # once a month
    assert AuditLog.objects.filter(tenant=tenant, action="budget.alert").count() == 1

    usage_add(tenant, amount="4.00", job=running)
    # the finish setting lets it run
    quota_set(tenant=tenant, actor=None, on_budget_exhausted="finish")
    assert budgets_enforce()["stopped"] == 0
    quota_set(tenant=tenant, actor=None, on_budget_exhausted="stop")
    other_running = job_make(other_tenant, state=JobState.RUNNING)
    assert budgets_enforce() == {"alerted": 0, "stopped": 1}
    with scopes_disabled():
        running.refresh_from_db()
        other_running.refresh_from_db()
    assert running.stop_requested == "cancel"
    assert "spend limit is reached" in running.stop_reason
    assert other_running.stop_requested == ""
    assert budgets_enforce()["stopped"] == 0  # idempotent: already asked to stop
    assert AuditLog.objects.filter(tenant=tenant, action="budget.stop_jobs").count() == 1


def test_admission_costs_a_fixed_number_of_queries(rules, tenant, django_assert_num_queries):
    """Take the admission lock and share-lock the tenant (one statement), then read the tenant, quota,
    plan, the default plan and the open and queued counts under them (another, sent with the first in one
    round trip), the month's cached totals, sum the windows after them, then the money hold: the price list,
    the open jobs' sizes with their metered amounts, the arrays whose tasks are not made yet, the live
    endpoints: 7 round trips, however many jobs, arrays and usage windows the tenant has."""
    quota_set(tenant=tenant, actor=None, max_open_jobs=100, monthly_spend_limit=Decimal(1000))
    for _ in range(5):
        usage_add(tenant, amount="1.00", job=submit(tenant))
    with django_assert_num_queries(7):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)


def test_admission_without_counted_limits_reads_only_the_limits(rules, tenant, django_assert_num_queries, monkeypatch):
    """No budget: take the admission lock (shared: far from the limits, as what this process read at its
    last submit says, so no look of its own) and share-lock the tenant in one statement, then read the
    limits and count the open and queued jobs under them in another, both in one round trip; no usage, no
    holds. A process that has not read the tenant yet looks once more, before the lock."""
    quota_set(tenant=tenant, actor=None, max_dedicated_gpus=4)
    for _ in range(5):
        submit(tenant)
    with django_assert_num_queries(1):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
    admission_services._counts_last.pop(tenant.pk)
    with django_assert_num_queries(2):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
    with django_assert_num_queries(1):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
    # Limits read longer ago than the hint lasts (another process may have changed them) are looked at again.
    monkeypatch.setattr(admission_services, "LIMITS_HINT_S", 0.0)
    with django_assert_num_queries(2):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
    monkeypatch.undo()
    # A minute later (a CI pipeline's next submit) the hint still stands: a wrong one costs an admission
    # again, so it lasts minutes.
    later = time.monotonic() + 60
    monkeypatch.setattr(admission_services, "time", SimpleNamespace(monotonic=lambda: later))
    with django_assert_num_queries(1):
        submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)


def test_month_totals_cache_is_exact(rules, tenant, other_tenant):
    """Cached totals + the live tail always equal the plain sum, before and after each advance,
    and whatever arrives late; last month's windows never count."""

    def plain(t):
        with scopes_disabled():
            windows = [w for w in UsageWindow.objects.filter(tenant=t) if w.start_ms >= month_bounds_ms()[0]]
        return MonthUsage(gpu_ms=sum(w.gpu_ms for w in windows), spend=sum((w.amount for w in windows), Decimal(0)))

    def age(windows, minutes):
        with scopes_disabled():
            UsageWindow.objects.filter(pk__in=[w.pk for w in windows]).update(
                received_at=timezone.now() - timedelta(minutes=minutes)
            )

    job_a, job_b = submit(tenant), submit(other_tenant)
    old = [usage_add(tenant, gpu_hours=5, amount="9.00", job=job_a, last_month=True)]
    age(old, 60 * 24 * 20)
    settled = [
        usage_add(tenant, gpu_hours=1, amount="1.50", job=job_a),
        usage_add(other_tenant, gpu_hours=2, job=job_b),
    ]
    age(settled, 30)
    fresh = [usage_add(tenant, gpu_hours=Decimal("0.25"), amount="0.10", job=job_a)]
    both = [tenant.pk, other_tenant.pk]

    assert month_usages(both) == {tenant.pk: plain(tenant), other_tenant.pk: plain(other_tenant)}
    cursor = month_usage_advance(both)
    assert cursor == settled[-1].pk  # the fresh window is not folded in yet
    with scopes_disabled():
        row = TenantMonthUsage.objects.get(tenant=tenant)
    assert (row.gpu_ms, row.spend) == (3_600_000, Decimal("1.50"))
    assert month_usages(both) == {tenant.pk: plain(tenant), other_tenant.pk: plain(other_tenant)}
    assert month_usage_advance(both) == cursor  # idempotent
    late = [usage_add(tenant, gpu_hours=2, amount="3.00", job=job_a)]
    age(fresh + late, 15)
    assert month_usages(both)[tenant.pk] == plain(tenant)
    month_usage_advance(both)
    with scopes_disabled():
        row.refresh_from_db()
    assert row.through_window_id == late[0].pk
    assert (
        month_usages(both)[tenant.pk]
        == plain(tenant)
        == MonthUsage(gpu_ms=int(Decimal("3.25") * 3_600_000), spend=Decimal("4.60"))
    )
    assert month_usages([other_tenant.pk]) == {other_tenant.pk: plain(other_tenant)}
