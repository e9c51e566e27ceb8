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
