"""One tenant's submits: side by side far from its limits, one after another where exactness needs it.

Each test holds one submit's transaction open (admitted, not committed) and starts a second
submit of the same tenant on another connection: far from the limits the second completes
while the first still holds; with a money budget or near a count limit it waits for the commit.
"""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from accounts.services import quota_set
from admission import services as admission_services
from scheduler.models import Job
from scheduler.services import JobError, JobSpec, job_submit
from tests.factories import TenantFactory, platform_rules_seed

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = JobSpec(kind="training", gpu_milli=1000, command=["true"], max_runtime_s=60)


class HeldSubmit:
    """A submit in a thread of its own whose transaction stays open until ``release()``."""

    def __init__(self, tenant):
        self.tenant = tenant
        self.admitted = threading.Event()
        self.release_now = threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            with transaction.atomic():
                job_submit(tenant=self.tenant, user=None, spec=SPEC)
                self.admitted.set()
                self.release_now.wait(30)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc
            self.admitted.set()
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        assert self.admitted.wait(30)
        assert self.error is None, self.error
        return self

    def release(self):
        self.release_now.set()
        self.thread.join(30)

    def __exit__(self, *exc):
        self.release()


def second_submit(tenant) -> tuple[threading.Thread, threading.Event, list]:
    done, outcome = threading.Event(), []

    def run():
        try:
            outcome.append(job_submit(tenant=tenant, user=None, spec=SPEC).pk)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            outcome.append(exc)
        finally:
            connection.close()
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, outcome


def open_jobs(tenant) -> int:
    with scopes_disabled():
        return Job.objects.filter(tenant=tenant).count()


@pytest.fixture
def tenant():
    platform_rules_seed()
    return TenantFactory(slug="lock-modes")


def test_far_from_its_limits_a_tenants_submits_do_not_wait_for_each_other(tenant):
    with HeldSubmit(tenant):
        _, done, outcome = second_submit(tenant)
        assert done.wait(20), "the second submit waited for the first one's commit"
        assert isinstance(outcome[0], int)
    assert open_jobs(tenant) == 2


def test_with_a_money_budget_the_second_submit_waits_for_the_first(tenant):
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100000.00"))
    with HeldSubmit(tenant) as first:
        _, done, outcome = second_submit(tenant)
        assert not done.wait(1.5), "a budgeted submit did not wait to see the first one's hold"
        first.release()
        assert done.wait(20) and isinstance(outcome[0], int)


def test_near_a_count_limit_the_second_submit_waits_and_sees_the_first(tenant):
    quota_set(tenant=tenant, actor=None, max_open_jobs=admission_services.in_flight_bound() + 1)
    with HeldSubmit(tenant) as first:
        _, done, outcome = second_submit(tenant)
        assert not done.wait(1.5), "a submit near the open-jobs limit did not wait for the one in flight"
        first.release()
        assert done.wait(20) and isinstance(outcome[0], int)


def test_far_from_a_limit_the_shared_path_still_refuses_what_passes_it(tenant):
    """The room left for transactions in flight is the database's connection limit; a limit
    reached in between refuses with the rule (exact path), never lets a job past it."""
    quota_set(tenant=tenant, actor=None, max_open_jobs=1)
    job_submit(tenant=tenant, user=None, spec=SPEC)
    with pytest.raises(JobError) as refused:
        job_submit(tenant=tenant, user=None, spec=SPEC)
    assert refused.value.code == "quota_exceeded" and "max_open_jobs is 1" in str(refused.value)


def test_the_in_flight_bound_is_the_servers_connection_limit():
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections")
        assert admission_services.in_flight_bound() == int(cursor.fetchone()[0])


def test_a_shared_admission_that_finds_the_counts_at_the_edge_asks_for_a_retry(tenant):
    """The unlocked look said "far", but an array committed before the shared lock was granted and
    brought the counts within the in-flight bound of the limit: the submit cannot prove it fits
    without waiting for the others, which a shared holder cannot do, so it answers 409 and keeps nothing."""
    from accounts.selectors import limits_for
    from scheduler.admission import JobAsk

    quota_set(tenant=tenant, actor=None, max_open_jobs=admission_services.in_flight_bound())
    ask = JobAsk(kind="training", mode="dedicated", gpu_milli=1000, max_runtime_s=60, price_multiplier=1, gpu_model="")
    counted = {"open_jobs": 0, "queued": 0}  # what the count under the lock found
    with pytest.raises(JobError) as refused:
        admission_services._counts_admitted(tenant, limits_for(tenant), ask, **counted, exact=False)
    assert refused.value.code == "conflict" and "retry" in str(refused.value)
    # The exact path admits the same job: there is room for it.
    admission_services._counts_admitted(tenant, limits_for(tenant), ask, **counted, exact=True)


def jobs_added_elsewhere(tenant, count: int) -> None:
    """``count`` queued jobs written past this process's admission (as another web process would)."""
    with scopes_disabled():
        template = Job.objects.filter(tenant=tenant).first()
        Job.objects.bulk_create(
            Job(
                tenant=tenant,
                kind=template.kind,
                mode=template.mode,
                gpu_milli=template.gpu_milli,
                command=["true"],
                priority=template.priority,
                max_runtime_s=60,
            )
            for _ in range(count)
        )


def test_a_submit_a_stale_hint_sends_down_the_shared_path_near_a_limit_is_admitted_again_exactly(tenant):
    """The unlocked look reads the counts this process saw last (a hint, not a query). Jobs other
    processes added since make it stale: the submit takes the shared path, its count under the lock
    finds it within the in-flight bound of the limit, and it is run again, exactly, and admitted."""
    bound = admission_services.in_flight_bound()
    quota_set(tenant=tenant, actor=None, max_open_jobs=3 * bound)
    job_submit(tenant=tenant, user=None, spec=SPEC)
    assert admission_services._counts_last[tenant.pk] == (1, 1)
    jobs_added_elsewhere(tenant, 2 * bound)

    job_submit(tenant=tenant, user=None, spec=SPEC)  # no error: the second admission was exact
    assert open_jobs(tenant) == 2 * bound + 2
    assert admission_services._counts_last[tenant.pk] == (2 * bound + 2, 2 * bound + 2)

    # Inside a caller's transaction the shared lock stays until that one ends: the caller retries (409).
    admission_services._counts_last[tenant.pk] = (1, 1)
    with pytest.raises(JobError) as refused, transaction.atomic():
        job_submit(tenant=tenant, user=None, spec=SPEC)
    assert refused.value.code == "conflict" and "retry" in str(refused.value)
    assert open_jobs(tenant) == 2 * bound + 2


def test_a_spend_limit_set_since_the_last_look_sends_the_submit_down_the_exact_path(tenant):
    """The hint said no money limit (shared lock); an operator set one since, from another process. The
    limits read under the lock see it: the submit is run again with the exclusive lock (a money hold must
    see every other one) and admitted; inside a caller's transaction it answers 409 and keeps nothing."""
    job_submit(tenant=tenant, user=None, spec=SPEC)
    hint = admission_services._limits_last[tenant.pk]
    assert hint[0].monthly_spend_limit is None
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("100000.00"))
    assert tenant.pk not in admission_services._limits_last  # this process's own change drops its hint
    admission_services._limits_last[tenant.pk] = hint  # as if set by another process: this one's hint is stale

    shared, exclusive = (admission_services._tenant_locked_statement(exact, row=False).name for exact in (False, True))
    with CaptureQueriesContext(connection) as queries:
        job_submit(tenant=tenant, user=None, spec=SPEC)
    locks = [
        name
        for q in queries.captured_queries
        for name in (shared, exclusive)
        if q["sql"].startswith(f"EXECUTE {name} ")
    ]
    assert locks == [shared, exclusive], locks  # tried shared, run again exclusive
    assert open_jobs(tenant) == 2
    assert admission_services._limits_last[tenant.pk][0].monthly_spend_limit == Decimal("100000.00")

    admission_services._limits_last[tenant.pk] = hint
    with pytest.raises(JobError) as refused, transaction.atomic():
        job_submit(tenant=tenant, user=None, spec=SPEC)
    assert refused.value.code == "conflict" and "retry" in str(refused.value)
    assert open_jobs(tenant) == 2


def test_a_limit_already_passed_refuses_with_the_rule_on_the_shared_path_too(tenant):
    """Counts that pass the limit with nothing else in flight are a refusal, not a race: the rule
    is named at once (403), even where the submit cannot be run again (a caller's transaction)."""
    bound = admission_services.in_flight_bound()
    quota_set(tenant=tenant, actor=None, max_open_jobs=3 * bound)
    job_submit(tenant=tenant, user=None, spec=SPEC)
    jobs_added_elsewhere(tenant, 3 * bound - 1)
    admission_services._counts_last[tenant.pk] = (1, 1)
    with pytest.raises(JobError) as refused, transaction.atomic():
        job_submit(tenant=tenant, user=None, spec=SPEC)
    assert refused.value.code == "quota_exceeded" and f"max_open_jobs is {3 * bound}" in str(refused.value)


def test_a_submit_that_waited_for_the_lock_counts_the_job_committed_meanwhile(tenant):
    """The read under the locks is sent with them in one round trip, but is a statement of its own: its
    snapshot is taken once the locks are granted, so the job the first submit committed meanwhile counts."""
    quota_set(tenant=tenant, actor=None, max_open_jobs=1)
    with HeldSubmit(tenant) as first:
        _, done, outcome = second_submit(tenant)
        assert not done.wait(1.5), "a submit at the open-jobs limit did not wait for the one in flight"
        first.release()
        assert done.wait(20)
    assert isinstance(outcome[0], JobError) and outcome[0].code == "quota_exceeded", outcome
    assert "max_open_jobs" in str(outcome[0])
    assert open_jobs(tenant) == 1


def test_a_suspension_committed_while_a_submit_waited_refuses_it(tenant):
    """A suspension locks the tenant's row; a submit waiting on it reads the row the suspension left."""
    from accounts.models import Tenant

    suspended, release = threading.Event(), threading.Event()

    def suspend():
        try:
            with transaction.atomic(), scopes_disabled():
                Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
                Tenant.objects.filter(pk=tenant.pk).update(state=Tenant.State.SUSPENDED)
                suspended.set()
                release.wait(30)
        finally:
            connection.close()

    suspender = threading.Thread(target=suspend, daemon=True)
    suspender.start()
    assert suspended.wait(20)
    _, done, outcome = second_submit(tenant)
    assert not done.wait(1.5), "a submit did not wait for the suspension holding the tenant's row"
    release.set()
    suspender.join(20)
    assert done.wait(20)
    assert isinstance(outcome[0], JobError) and outcome[0].code == "forbidden", outcome
    assert open_jobs(tenant) == 0
