"""A submit's insert goes in admission's read, under its locks (one round trip less per submit), only where
nothing admission reads afterwards could see it; a refusal takes the write back with the transaction, and a
limit that the process had not seen yet is caught and the submit admitted again, exactly
(admission.services._write_sent, scheduler.admission.Write)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from accounts.models import TenantQuota
from accounts.services import quota_set
from admission import services as admission
from scheduler import services
from scheduler.array_services import job_array_submit
from scheduler.arrays import array_parse
from scheduler.models import Job, JobArray, JobEvent, SchedulerSettings
from scheduler.services import JobError, JobSpec, job_submit
from tests.admission.test_holds import hold_of, spec

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the write goes with the read on PostgreSQL"),
]


@pytest.fixture(autouse=True)
def no_hints():
    """No class or limits hint from an earlier test (whose classes and tenants are gone)."""
    for hints in (services._class_hints, admission._limits_last, admission._counts_last):
        hints.clear()


@pytest.fixture
def sent(monkeypatch):
    """Whether each admission read carried the submit's write, in order."""
    seen: list[bool] = []
    read = admission._tenant_locked_with_limits

    def spy(tenant, *, exact, write=None):
        seen.append(write is not None)
        return read(tenant, exact=exact, write=write)

    monkeypatch.setattr(admission, "_tenant_locked_with_limits", spy)
    return seen


def round_trips(call) -> tuple[object, int]:
    """What ``call()`` answered, and how many statements it sent (a statement's first PREPARE on a
    connection aside)."""
    with CaptureQueriesContext(connection) as queries:
        answer = call()
    return answer, sum(not q["sql"].startswith("PREPARE") for q in queries.captured_queries)


def counts(tenant) -> tuple[int, int, int]:
    with scopes_disabled():
        return (
            Job.objects.filter(tenant=tenant).count(),
            JobEvent.objects.filter(tenant=tenant).count(),
            JobArray.objects.filter(tenant=tenant).count(),
        )


def array_of(tenant, count: int, **changes):
    job_spec = JobSpec(**{"kind": "inference", "gpu_milli": 125, "command": ["true"], **changes})
    return job_array_submit(tenant=tenant, user=None, spec=job_spec, array=array_parse({"count": count}))


def test_a_tenants_next_submit_writes_in_the_admission_read_one_round_trip_less(rules, tenant, sent, monkeypatch):
    job_submit(tenant=tenant, user=None, spec=spec())  # this process reads the tenant's limits
    with monkeypatch.context() as apart:
        apart.setattr(admission, "_write_sent", lambda tenant, write: None)
        first, before = round_trips(lambda: job_submit(tenant=tenant, user=None, spec=spec()))
    second, after = round_trips(lambda: job_submit(tenant=tenant, user=None, spec=spec()))
    assert sent == [False, False, True]  # the first: no limits read by this process yet
    assert after == before - 1  # the insert went with the locks and the read (the test's savepoint aside)
    assert second.pk > first.pk and second.api_queue_position == first.api_queue_position + 1
    with scopes_disabled():
        job = Job.objects.get(pk=second.pk)
        assert job.state == "queued" and job.max_runtime_s == first.max_runtime_s
        assert list(JobEvent.objects.filter(job=job).values_list("detail", flat=True)) == ["submitted"]
    assert counts(tenant)[:2] == (3, 3)


def test_an_arrays_record_is_written_in_the_admission_read(rules, tenant, sent):
    array_of(tenant, 2)
    made, _ = round_trips(lambda: array_of(tenant, 3, name="sweep"))
    assert sent == [False, True]  # the first: no limits read by this process yet
    with scopes_disabled():
        stored = JobArray.objects.get(pk=made.pk)
    assert stored.task_count == 3 and stored.name == "sweep" and stored.task_spec["gpu_milli"] == 125


def test_a_refused_submit_leaves_nothing_of_its_write(rules, tenant, sent):
    quota_set(tenant=tenant, actor=None, max_open_jobs=1)
    job_submit(tenant=tenant, user=None, spec=spec())
    with pytest.raises(JobError) as refused:
        job_submit(tenant=tenant, user=None, spec=spec())
    assert refused.value.code == "quota_exceeded" and sent == [False, True]
    assert counts(tenant) == (1, 1, 0)


def test_a_refused_array_leaves_no_record(rules, tenant, sent):
    quota_set(tenant=tenant, actor=None, max_queued_jobs=3)
    job_submit(tenant=tenant, user=None, spec=spec())
    with pytest.raises(JobError, match="the array has 3 tasks"):
        array_of(tenant, 3)
    assert sent == [False, True]
    assert counts(tenant) == (1, 1, 0)


def test_a_spend_limit_keeps_the_write_out_of_the_read_and_holds_are_counted_once(rules, tenant, sent, monkeypatch):
    """With a spend limit admission reads the open holds after the limits: a job written with the first read
    would be in them, its hold counted twice, and the second job of two that fit refused. The write is not
    even made."""
    made = []
    monkeypatch.setattr(services, "job_insert_write", lambda *a, **kw: made.append(1))
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=(2 * hold_of()).quantize(Decimal("0.01")) + 1)
    job_submit(tenant=tenant, user=None, spec=spec())
    job_submit(tenant=tenant, user=None, spec=spec())
    with pytest.raises(JobError) as refused:
        job_submit(tenant=tenant, user=None, spec=spec())
    assert refused.value.code == "budget_exceeded"
    assert sent == [False, False, False] and made == []
    assert counts(tenant)[0] == 2


@pytest.mark.django_db(transaction=True)  # admitted again: a whole transaction run once more
@pytest.mark.parametrize("fits", [True, False])
def test_a_spend_limit_set_by_another_process_is_seen_and_the_job_admitted_again_exactly(rules, tenant, sent, fits):
    """This process last saw no spend limit, so the write goes with the read; the read shows the limit another
    process set (no signal here): the submit is admitted again, without the write, against the budget."""
    quota_set(tenant=tenant, actor=None, max_open_jobs=100)
    job_submit(tenant=tenant, user=None, spec=spec())
    limit = hold_of() * (Decimal("2.5") if fits else Decimal("0.5"))  # the first job holds one hold
    with scopes_disabled():  # as another process would: no signal drops this process's hint
        TenantQuota.objects.filter(tenant=tenant).update(monthly_spend_limit=limit.quantize(Decimal("0.01")))
    if fits:
        job_submit(tenant=tenant, user=None, spec=spec())
        assert counts(tenant)[:2] == (2, 2)
    else:
        with pytest.raises(JobError) as refused:
            job_submit(tenant=tenant, user=None, spec=spec())
        assert refused.value.code == "budget_exceeded"
        assert counts(tenant)[:2] == (1, 1)
    assert sent == [False, True, False]  # the write went, the limit was seen, admitted again without it


def test_an_array_whose_class_changed_since_the_hint_is_written_once_with_what_is_true_now(rules, tenant, sent):
    first = array_of(tenant, 2, max_runtime_s=None)
    SchedulerSettings.objects.update_or_create(pk=1, defaults={"default_max_runtime_s": 1234})
    made = array_of(tenant, 2, max_runtime_s=None)
    # The write went with the class as hinted, was not written (the rules changed), and the array was
    # admitted again with the class read again, then written.
    assert sent == [False, True, False]
    with scopes_disabled():
        assert JobArray.objects.filter(tenant=tenant).count() == 2
        assert JobArray.objects.get(pk=first.pk).task_spec["max_runtime_s"] != 1234
        assert JobArray.objects.get(pk=made.pk).task_spec["max_runtime_s"] == 1234
