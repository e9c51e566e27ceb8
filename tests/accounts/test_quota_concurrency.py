"""50 simultaneous submits over HTTP (live server, one thread per request, PostgreSQL)
can never put a tenant over a limit: the admission check holds the tenant row FOR SHARE
and, for a tenant with max_open_jobs, a per-tenant lock that serialises its submits.
Submits of a tenant without that limit do not wait for each other; a suspension waits
for the submits in flight."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.db import connections
from django_scopes import scopes_disabled

from accounts.models import Role
from accounts.services import quota_set
from scheduler.models import Job
from scheduler.services import JobSpec, job_submit
from tests.factories import TenantFactory, platform_rules_seed, token_for

SUBMITS = 50


def _fire(url: str, token: str, count: int) -> list[requests.Response]:
    barrier = threading.Barrier(count, timeout=60)

    def one(i: int) -> requests.Response:
        barrier.wait()
        return requests.post(
            f"{url}/api/v1/jobs/",
            json={"kind": "training", "gpus": 1, "command": ["sleep", "1"], "name": f"race-{i}"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
        )

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(one, range(count)))


@pytest.mark.django_db(transaction=True)
def test_fifty_simultaneous_submits_never_pass_the_open_jobs_limit(burst_server):
    platform_rules_seed()
    tenant, neighbour = TenantFactory(slug="race-a"), TenantFactory(slug="race-b")
    quota_set(tenant=tenant, actor=None, max_open_jobs=7)
    quota_set(tenant=neighbour, actor=None, max_open_jobs=3)
    token = token_for(tenant, role=Role.MEMBER)

    responses = _fire(burst_server, token, SUBMITS)

    statuses = Counter(r.status_code for r in responses)
    assert statuses == {201: 7, 403: SUBMITS - 7}, statuses
    refusals = [r.json()["error"] for r in responses if r.status_code == 403]
    assert {e["code"] for e in refusals} == {"quota_exceeded"}
    assert all("max_open_jobs is 7" in e["message"] for e in refusals)
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 7
        assert Job.objects.filter(tenant=neighbour).count() == 0


@pytest.mark.django_db(transaction=True)
def test_fifty_threads_racing_for_the_last_open_slot():
    """Threads calling the service directly: with one open slot left, exactly one wins.

    Measured without the row lock (select_for_update removed): 30 of 50 won here and 16 of 50
    (limit 7) in the HTTP test above."""
    platform_rules_seed()
    tenant = TenantFactory(slug="race-c")
    quota_set(tenant=tenant, actor=None, max_open_jobs=5)
    for _ in range(4):
        job_submit(tenant=tenant, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["true"]))
    barrier = threading.Barrier(SUBMITS, timeout=60)

    def one(_):
        barrier.wait()
        try:
            job_submit(tenant=tenant, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["true"]))
            return "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test counts
            return getattr(exc, "code", repr(exc))
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=SUBMITS) as pool:
        outcomes = Counter(pool.map(one, range(SUBMITS)))
    assert outcomes == {"ok": 1, "quota_exceeded": SUBMITS - 1}, outcomes
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 5


@pytest.mark.django_db(transaction=True)
def test_the_tenant_lock_does_not_block_rows_that_merely_reference_the_tenant():
    """submission_check locks the tenant FOR SHARE: a scheduling pass inserting an allocation (a foreign
    key to the tenant, which takes FOR KEY SHARE) is not blocked by a submit in flight, so a suspend
    (tenant lock, then job locks) and a pass (job locks, then tenant FK) cannot deadlock."""
    import time

    from django.db import transaction

    from accounts.models import AuditLog
    from tests.accounts.helpers import submission_check

    platform_rules_seed()
    tenant = TenantFactory(slug="race-d")
    locked, release = threading.Event(), threading.Event()

    def hold_lock():
        try:
            with transaction.atomic():
                submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert locked.wait(30)
    started = time.monotonic()
    try:
        with transaction.atomic():
            with connections["default"].cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '3s'")
            AuditLog.objects.create(tenant=tenant, action="test.reference")  # FK check: FOR KEY SHARE
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join(30)
    assert elapsed < 2.5


def _hold_admission(tenant, locked: threading.Event, release: threading.Event) -> threading.Thread:
    """A thread that passes submission_check for ``tenant`` and keeps its transaction open until ``release``."""
    from django.db import transaction

    from tests.accounts.helpers import submission_check

    def hold():
        try:
            with transaction.atomic():
                submission_check(tenant=tenant, mode="dedicated", gpu_milli=1000)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(30)
    return thread


def _with_lock_timeout(fn, timeout: str = "2s"):
    """Run ``fn`` in a transaction that gives up waiting for a lock after ``timeout``."""
    from django.db import transaction

    with transaction.atomic():
        with connections["default"].cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{timeout}'")
        return fn()


@pytest.mark.django_db(transaction=True)
def test_submits_of_other_tenants_do_not_wait_for_one_in_flight():
    """Every plan limits open and queued jobs (accounts.limits.PLAN_DEFAULTS), so one tenant's submits
    are admitted one after another; another tenant's submit does not wait for them."""
    import time

    platform_rules_seed()
    tenant, other = TenantFactory(slug="race-e"), TenantFactory(slug="race-e2")
    quota_set(tenant=tenant, actor=None, max_dedicated_gpus=2)
    locked, release = threading.Event(), threading.Event()
    holder = _hold_admission(tenant, locked, release)
    started = time.monotonic()
    try:
        job = _with_lock_timeout(
            lambda: job_submit(tenant=other, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["x"]))
        )
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join(30)
    assert job.pk and elapsed < 1.5


@pytest.mark.django_db(transaction=True)
def test_submits_of_a_tenant_with_an_open_jobs_limit_wait_for_the_one_in_flight():
    from django.db import OperationalError

    platform_rules_seed()
    tenant = TenantFactory(slug="race-f")
    quota_set(tenant=tenant, actor=None, max_open_jobs=10)
    locked, release = threading.Event(), threading.Event()
    holder = _hold_admission(tenant, locked, release)
    try:
        with pytest.raises(OperationalError, match="lock timeout"):
            _with_lock_timeout(
                lambda: job_submit(
                    tenant=tenant, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["x"])
                ),
                "500ms",
            )
    finally:
        release.set()
        holder.join(30)


@pytest.mark.django_db(transaction=True)
def test_a_suspension_waits_for_the_submits_in_flight():
    """A submit that passed the state check commits before the suspension does: no job is ever
    admitted after a suspension committed."""
    from django.db import OperationalError

    from accounts.services import tenant_suspend

    platform_rules_seed()
    tenant = TenantFactory(slug="race-g")
    locked, release = threading.Event(), threading.Event()
    holder = _hold_admission(tenant, locked, release)
    try:
        with pytest.raises(OperationalError, match="lock timeout"):
            _with_lock_timeout(lambda: tenant_suspend(tenant=tenant, actor=None, reason="unpaid"), "500ms")
    finally:
        release.set()
        holder.join(30)
    tenant_suspend(tenant=tenant, actor=None, reason="unpaid")  # once the submit has committed
