"""A submitted job is written in one statement with its "submitted" event (scheduler.services.job_insert):
the row must be the one ``Model.save()`` writes, column for column."""

from __future__ import annotations

import pytest
from django.db import connection
from django.forms.models import model_to_dict
from django_scopes import scopes_disabled

from scheduler.models import Job, JobEvent, JobState, PriorityClass
from scheduler.services import job_insert
from tests.factories import member_add

pytestmark = pytest.mark.django_db


def new_job(tenant, user, **changes) -> Job:
    values = {
        "tenant": tenant,
        "submitted_by": user,
        "name": "sweep-7 ünïcode",
        "kind": "inference",
        "mode": "shared",
        "gpu_milli": 250,
        "command": ["python", "-c", "print('{}')", {"nested": [1, None]}],
        "env": {"SEED": "7", "EMPTY": ""},
        "image": "registry.example/ml:1",
        "gpu_model": "L4",
        "gpu_memory_mb": 12000,
        "priority": PriorityClass.objects.order_by("rank").first(),
        "max_runtime_s": 600,
        "pending_reason": "waiting for the next scheduling pass",
    }
    return Job(**{**values, **changes})


def test_the_row_is_the_one_save_writes_and_the_event_comes_with_it(rules, tenant):
    user = member_add(tenant)
    with scopes_disabled():
        inserted = job_insert(new_job(tenant, user))
        saved = new_job(tenant, user)
        saved.save(force_insert=True)
        fresh = Job.objects.get(pk=inserted.pk)
        reference = Job.objects.get(pk=saved.pk)
        events = list(JobEvent.objects.filter(job=fresh).values_list("at", "from_state", "to_state", "detail"))
    assert inserted.pk and not inserted._state.adding
    ignore = ("id", "submitted_at")
    assert {k: v for k, v in model_to_dict(fresh).items() if k not in ignore} == {
        k: v for k, v in model_to_dict(reference).items() if k not in ignore
    }
    assert fresh.submitted_at == inserted.submitted_at  # set by the field's pre_save, as save() does
    assert fresh.state == JobState.QUEUED
    expected_event = [(fresh.submitted_at, "", JobState.QUEUED, "submitted")]
    assert (
        events == expected_event
        if connection.vendor == "postgresql"
        else [e[1:] for e in events] == [e[1:] for e in expected_event]
    )


def test_the_position_it_answers_is_the_queues_once_committed(rules, tenant, other_tenant):
    """The insert answers the new job's queue position from the same statement; it must be what
    queue_positions_page reads afterwards, with higher classes, earlier jobs of its class, later ones
    and other tenants' jobs in the queue."""
    from scheduler.api.selectors import queue_positions_page

    user = member_add(tenant)
    ranks = list(PriorityClass.objects.order_by("rank"))
    low, high = ranks[0], ranks[-1]
    assert low.rank < high.rank
    with scopes_disabled():
        answered = {}
        for owner, priority in [(tenant, low), (other_tenant, high), (tenant, high), (other_tenant, low)] * 3:
            job = job_insert(new_job(owner, user if owner == tenant else None, priority=priority))
            answered[job.pk] = (owner.pk, job.api_queue_position)
        Job.objects.filter(pk=min(answered)).update(state=JobState.CANCELLED)  # one leaves the queue
        late = job_insert(new_job(tenant, user, priority=low))
        answered[late.pk] = (tenant.pk, late.api_queue_position)
        queued = Job.objects.filter(state=JobState.QUEUED).count()
        high_ones = set(Job.objects.filter(pk__in=list(answered), priority=high).values_list("pk", flat=True))
    assert late.api_queue_position == queued  # the lowest class's newest job is last
    # Each answer was right when given: a job of the high class is behind the high ones before it only.
    assert [answered[pk][1] for pk in sorted(high_ones)] == list(range(1, len(high_ones) + 1))
    now = queue_positions_page(tenant=tenant.pk, job_ids=[late.pk])
    assert now == {late.pk: late.api_queue_position}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"env": {}, "command": [], "name": "", "image": ""},
        {"gpu_memory_mb": None, "submitted_by": None},
        # Values not in the driver's form already: each must still go through its field.
        {"name": 12345, "gpu_milli": "250", "max_runtime_s": True, "cost": "1.50", "exit_code": -9},
        {"command": "true", "env": None, "estimated_start_at": "2026-01-02T03:04:05Z"},
    ],
)
def test_insert_values_are_what_the_fields_would_prepare(rules, tenant, changes):
    """``insert_values`` passes a str or int (or None) as it is where the field would hand it over unchanged;
    what reaches PostgreSQL must be byte for byte what ``get_db_prep_save`` makes of every value."""
    from gpushare.prepared import insert_values
    from scheduler.services import job_row_fields

    user = member_add(tenant)
    fields = job_row_fields()
    with scopes_disabled():
        job = new_job(tenant, user, **changes)
        fast = insert_values(job, fields)
        slow = [f.get_db_prep_save(f.pre_save(job, True), connection) for f in fields]
    with connection.cursor() as cursor:
        for field, mine, theirs in zip(fields, fast, slow, strict=True):
            if field.attname == "submitted_at":  # auto_now_add: set again by each pre_save
                continue
            assert cursor.mogrify("%s", [mine]) == cursor.mogrify("%s", [theirs]), field.attname
