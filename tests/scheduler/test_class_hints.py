"""A single submit takes its priority class from this process's hint (one statement less on the hot path)
and the insert checks the hint is still true: a class or the scheduler settings changed since are read
again, and the job is admitted and written with what is true now (scheduler.services.priority_hinted)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from accounts.services import quota_set
from scheduler import services
from scheduler.models import Job, PriorityClass, SchedulerSettings
from scheduler.rules import priority_class_update
from scheduler.services import JobError, JobSpec, job_submit

pytestmark = pytest.mark.django_db

pg_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="hints need row versions (PostgreSQL)")


def submit(tenant, **changes):
    spec = JobSpec(**{"kind": "training", "gpu_milli": 1000, "command": ["true"], **changes})
    with CaptureQueriesContext(connection) as queries:
        job = job_submit(tenant=tenant, user=None, spec=spec)
    with scopes_disabled():
        job = Job.objects.select_related("priority").get(pk=job.pk)
    looked_up = any(f"EXECUTE {services._priority_statement().name}" in q["sql"] for q in queries.captured_queries)
    return job, looked_up


@pytest.fixture(autouse=True)
def no_hints():
    services._class_hints.clear()
    yield
    services._class_hints.clear()


@pg_only
def test_the_second_submit_of_a_shape_uses_the_hint(rules, tenant):
    first, looked_up = submit(tenant)
    assert looked_up
    second, looked_up = submit(tenant)
    assert not looked_up
    assert second.priority_id == first.priority_id and second.max_runtime_s == first.max_runtime_s
    _, looked_up = submit(tenant, priority="standard")  # another shape: a hint of its own
    assert looked_up


@pg_only
def test_a_class_changed_since_the_hint_is_read_again_and_the_job_gets_what_is_true_now(rules, tenant):
    with scopes_disabled():
        standard = PriorityClass.objects.get(name="standard")
    first, _ = submit(tenant, priority="standard", max_runtime_s=None)
    priority_class_update(actor=None, priority_class=standard, changes={"price_multiplier": Decimal("2.50")})
    second, looked_up = submit(tenant, priority="standard", max_runtime_s=None)
    assert looked_up and second.priority.price_multiplier == Decimal("2.50")
    _, looked_up = submit(tenant, priority="standard", max_runtime_s=None)
    assert not looked_up  # the hint was renewed

    SchedulerSettings.objects.update_or_create(pk=1, defaults={"default_max_runtime_s": first.max_runtime_s + 60})
    third, looked_up = submit(tenant, priority="standard", max_runtime_s=None)
    assert looked_up and third.max_runtime_s == first.max_runtime_s + 60


@pg_only
def test_a_new_default_class_for_the_kind_takes_the_next_submit(rules, tenant):
    before, _ = submit(tenant)
    top = PriorityClass.objects.order_by("-rank").first()
    PriorityClass.objects.create(name="urgent", rank=top.rank + 10, default_for_kind="training")
    after, looked_up = submit(tenant)
    assert looked_up and after.priority.name == "urgent" != before.priority.name


@pg_only
def test_admission_runs_again_with_the_class_that_is_true_now(rules, tenant):
    """The hint's class was admitted against the budget; its multiplier then went up to 100: the job is admitted
    again with the new one, and refused (the stale class would have let it through)."""
    with scopes_disabled():
        standard = PriorityClass.objects.get(name="standard")
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("50.00"))
    submit(tenant, priority="standard", max_runtime_s=60)  # the hint: fits easily
    priority_class_update(actor=None, priority_class=standard, changes={"price_multiplier": Decimal("100")})
    with pytest.raises(JobError) as refused:
        submit(tenant, priority="standard", max_runtime_s=3600)
    assert refused.value.code == "budget_exceeded"


@pg_only
def test_an_array_takes_the_hint_and_a_changed_class_reaches_its_tasks(rules, tenant):
    from scheduler.array_services import array_tasks_make, job_array_submit
    from scheduler.arrays import array_parse

    def submit_array():
        spec = JobSpec(kind="training", gpu_milli=1000, command=["true"], priority="standard")
        with CaptureQueriesContext(connection) as queries:
            array = job_array_submit(tenant=tenant, user=None, spec=spec, array=array_parse({"count": 2}))
        name = services._priority_statement().name
        return array, any(f"EXECUTE {name}" in q["sql"] for q in queries.captured_queries)

    _, looked_up = submit_array()
    assert looked_up
    _, looked_up = submit_array()
    assert not looked_up
    with scopes_disabled():
        standard = PriorityClass.objects.get(name="standard")
    priority_class_update(actor=None, priority_class=standard, changes={"price_multiplier": Decimal("3.00")})
    SchedulerSettings.objects.update_or_create(pk=1, defaults={"default_max_runtime_s": 4321})
    array, looked_up = submit_array()
    assert looked_up
    with scopes_disabled():
        array_tasks_make(array=array)
        tasks = list(Job.objects.filter(array_id=array.pk).select_related("priority"))
    assert len(tasks) == 2 and {(t.priority.price_multiplier, t.max_runtime_s) for t in tasks} == {
        (Decimal("3.00"), 4321)
    }
