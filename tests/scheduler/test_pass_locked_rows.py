"""A pass that finds a queued job held by another transaction asks for the next pass itself.

Nothing else may: the holder can be a report about an older attempt that changes
nothing the scheduler watches, and tests (like a quiet cluster between beat's
passes) have no other trigger. Found as a job that never ran again after its
node came back (tests/agents/test_node_lifecycle.py under load).
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django_scopes import scopes_disabled

from scheduler import passes
from scheduler.models import Job, JobState
from scheduler.services import schedule_pass
from tests.factories import TenantFactory
from tests.scheduler.conftest import node_add, reload, submit


@pytest.fixture
def requested(monkeypatch):
    asked: list[int] = []
    monkeypatch.setattr(passes, "pass_request", lambda *, min_wait_ms=0, submitted=False: asked.append(min_wait_ms))
    return asked


def _hold_row(job_id: int, locked: threading.Event, release: threading.Event) -> None:
    try:
        with transaction.atomic(), scopes_disabled():
            Job.objects.select_for_update().get(pk=job_id)
            locked.set()
            release.wait(30)
    finally:
        connection.close()


def test_a_pass_that_skipped_a_held_row_asks_for_the_next_one(transactional_db, rules, requested):
    node_add("n1", 2)
    tenant = TenantFactory(slug="acme")
    held, free = submit(tenant), submit(tenant)
    requested.clear()  # the submits' own triggers
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_row, args=(held.pk, locked, release))
    holder.start()
    try:
        assert locked.wait(10)
        schedule_pass()
    finally:
        release.set()
        holder.join(30)
    assert reload(free).state == JobState.SCHEDULED
    assert reload(held).state == JobState.QUEUED  # skipped while held ...
    assert requested == [passes.LOCKED_ROWS_RETRY_MS]  # ... and the next pass is asked for
    schedule_pass()
    assert reload(held).state == JobState.SCHEDULED


def test_a_pass_that_saw_every_queued_row_asks_for_nothing(transactional_db, rules, requested):
    node_add("n1", 1)
    tenant = TenantFactory(slug="acme")
    submit(tenant), submit(tenant)  # one fits, one waits for the GPU
    requested.clear()
    schedule_pass()
    assert requested == []


def _submit_at_queue_read(tenant, late: list, *, before: bool):
    """An execute wrapper: when the pass is about to read (``before``) or has just read its queue, a job of
    ``tenant`` is submitted and committed on another connection (once; appended to ``late``)."""

    def submit_elsewhere() -> None:
        try:
            late.append(submit(tenant))
        finally:
            connection.close()

    def wrapper(execute, sql, params, many, context):
        queue_read = "SKIP LOCKED" in sql and "estimated_start_at" in sql and not late
        if queue_read and before:
            _in_another_thread(submit_elsewhere)
        result = execute(sql, params, many, context)
        if queue_read and not before:
            _in_another_thread(submit_elsewhere)
        return result

    return wrapper


def _in_another_thread(target) -> None:
    other = threading.Thread(target=target)
    other.start()
    other.join(30)


def test_jobs_submitted_while_a_pass_reads_the_queue_are_not_taken_for_held_rows(transactional_db, rules, requested):
    """Under a stream of submits, jobs commit while a pass runs. The queued rows the pass locked and every
    queued row are counted in one snapshot: a job committed just after its read is the next pass's, not a
    row some transaction holds (which asked for a retry after nearly every pass and cleared the pace
    submits are held to)."""

    node_add("n1", 1)
    tenant = TenantFactory(slug="acme")
    submit(tenant), submit(tenant)  # one fits, one waits for the GPU
    requested.clear()
    late: list[Job] = []
    with connection.execute_wrapper(_submit_at_queue_read(tenant, late, before=False)):  # just after the read
        schedule_pass()
    assert late and reload(late[0]).state == JobState.QUEUED
    assert requested == [0]  # the late submit's own trigger; no retry for rows "held"


def test_a_job_committed_as_the_pass_starts_is_not_placed_before_it_was_queued(transactional_db, rules, requested):
    """The pass's clock is read after its queue read: a job requeued (or submitted) while the pass was
    starting is placed by it, and its timeline must not show the placement before the requeue (found as
    a defragmentation timeline in CI with "placed on" ahead of "requeued to be placed again")."""
    from scheduler.models import JobEvent

    node_add("n1", 1)
    tenant = TenantFactory(slug="acme")
    late: list[Job] = []
    with connection.execute_wrapper(_submit_at_queue_read(tenant, late, before=True)):  # its event stamped now
        schedule_pass()
    assert late and reload(late[0]).state == JobState.SCHEDULED
    with scopes_disabled():
        timeline = list(JobEvent.objects.filter(job_id=late[0].pk).values_list("to_state", "at"))
    assert [state for state, _ in timeline] == [JobState.QUEUED, JobState.SCHEDULED]
    assert timeline[1][1] >= timeline[0][1]
