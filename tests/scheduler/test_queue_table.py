"""The narrow queue table (``QueuedJob``) is kept by PostgreSQL triggers: after every kind of change a
job goes through, it holds exactly the queued jobs with their class and submission time, and the
queue positions the API shows (counted on it) are the places of a ranking of every queued job."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django_scopes import scopes_disabled

from console.services import job_priority_change
from scheduler.api.selectors import queue_positions
from scheduler.array_services import job_array_cancel, job_array_submit
from scheduler.arrays import array_parse
from scheduler.models import Job, JobState, PriorityClass, QueuedJob
from scheduler.services import JobSpec, job_cancel, schedule_pass
from tests.scheduler.conftest import node_add, submit

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="the triggers are PostgreSQL's")


def queue_rows() -> set[tuple[int, int, object]]:
    return set(QueuedJob.objects.values_list("job_id", "priority_id", "submitted_at"))


def queued_jobs() -> set[tuple[int, int, object]]:
    with scopes_disabled():
        return set(Job.objects.filter(state=JobState.QUEUED).values_list("pk", "priority_id", "submitted_at"))


def ranking() -> dict[int, int]:
    """Every queued job's place, computed in Python: higher class first, then first come."""
    with scopes_disabled():
        jobs = list(Job.objects.filter(state=JobState.QUEUED).values_list("pk", "priority__rank", "submitted_at"))
    ordered = sorted(jobs, key=lambda j: (-j[1], j[2], j[0]))
    return {pk: place for place, (pk, _, _) in enumerate(ordered, start=1)}


def assert_queue_true(tenants):
    assert queue_rows() == queued_jobs()
    expected = ranking()
    shown = {}
    for tenant in tenants:
        with scopes_disabled():
            ids = list(Job.objects.filter(tenant=tenant).values_list("pk", flat=True))
        shown.update(queue_positions(tenant=tenant, job_ids=ids))
    assert shown == expected


def test_the_queue_table_follows_every_change_of_a_job(sched, tenant, other_tenant, django_user_model):
    node_add("n1", 2)
    a = [submit(tenant, gpus=1) for _ in range(3)]
    b = [submit(other_tenant, gpus=0.25, priority="preemptible") for _ in range(2)]
    spec = JobSpec(kind="inference", gpu_milli=250, command=["true"])
    array = job_array_submit(tenant=other_tenant, user=None, spec=spec, array=array_parse({"count": 4}))
    assert len(queue_rows()) == 9
    assert_queue_true([tenant, other_tenant])

    schedule_pass()  # placements leave the queue
    with scopes_disabled():
        placed = Job.objects.filter(state=JobState.SCHEDULED).count()
    assert placed > 0 and len(queue_rows()) == 9 - placed
    assert_queue_true([tenant, other_tenant])

    job_cancel(job=a[2], reason="test")  # a cancel (queued -> cancelled)
    job_array_cancel(array=array)  # a bulk UPDATE of the array's queued tasks
    assert_queue_true([tenant, other_tenant])

    operator = django_user_model.objects.create(username="op", is_staff=True, is_superuser=True)
    highest = PriorityClass.objects.order_by("-rank").first()
    with scopes_disabled():
        waiting = Job.objects.filter(state=JobState.QUEUED).order_by("pk").last()
    job_priority_change(job=waiting, priority=highest, actor=operator)  # a class change moves it up the queue
    assert_queue_true([tenant, other_tenant])
    assert ranking()[waiting.pk] == 1

    with scopes_disabled():  # submission time rewritten (a requeue keeps its place; a change must follow)
        Job.objects.filter(pk=b[0].pk).update(submitted_at=b[0].submitted_at - timedelta(days=1))
        Job.objects.filter(state=JobState.SCHEDULED).update(state=JobState.QUEUED)  # back to the queue
        Job.objects.filter(pk=b[1].pk).update(pending_reason="rewritten")  # not a queue change
    assert_queue_true([tenant, other_tenant])

    with scopes_disabled():
        Job.objects.filter(pk=b[0].pk).delete()
    assert_queue_true([tenant, other_tenant])
    assert b[0].pk not in {pk for pk, _, _ in queue_rows()}
