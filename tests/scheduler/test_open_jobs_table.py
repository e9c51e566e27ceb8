"""The narrow table of unfinished jobs (``OpenJob``) and the open/queued counts per tenant and class
(``OpenJobCount`` plus its changes not folded yet) are kept by PostgreSQL triggers: after every kind of
change a job goes through, and after a fold, they hold exactly the open jobs with their tenant, class,
submission time and state and their counts; the queue positions the API shows and the counts admission
checks are those of the jobs themselves."""

from __future__ import annotations

import importlib
import time
from datetime import timedelta

import pytest
from django.db import connection
from django_scopes import scopes_disabled

from admission.selectors import job_counts
from console.services import job_priority_change
from scheduler.api.selectors import queue_positions, queue_positions_page
from scheduler.array_services import arrays_waiting_make, job_array_cancel, job_array_submit
from scheduler.arrays import array_parse
from scheduler.counts import counts_fold
from scheduler.models import OPEN_STATES, Job, JobState, OpenJob, OpenJobCount, OpenJobCountChange, PriorityClass
from scheduler.services import JobSpec, job_cancel, job_exited, job_started, schedule_pass
from tests.scheduler.conftest import node_add, submit

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="the triggers are PostgreSQL's")


def table_rows() -> set[tuple]:
    with scopes_disabled():
        return set(OpenJob.objects.values_list("job_id", "tenant_id", "priority_id", "submitted_at", "state"))


def open_jobs() -> set[tuple]:
    with scopes_disabled():
        rows = Job.objects.filter(state__in=OPEN_STATES)
        return set(rows.values_list("pk", "tenant_id", "priority_id", "submitted_at", "state"))


def ranking() -> dict[int, int]:
    """Every queued job's place, computed in Python: higher class first, then first come."""
    with scopes_disabled():
        jobs = list(Job.objects.filter(state=JobState.QUEUED).values_list("pk", "priority__rank", "submitted_at"))
    ordered = sorted(jobs, key=lambda j: (-j[1], j[2], j[0]))
    return {pk: place for place, (pk, _, _) in enumerate(ordered, start=1)}


def kept_counts() -> dict[tuple, tuple]:
    """(tenant, class) -> (open, queued) as the database keeps them: folded rows plus changes not folded."""
    out: dict[tuple, list] = {}
    with scopes_disabled():
        for model in (OpenJobCount, OpenJobCountChange):
            for tenant_id, priority_id, n_open, n_queued in model.objects.values_list(
                "tenant_id", "priority_id", "open", "queued"
            ):
                kept = out.setdefault((tenant_id, priority_id), [0, 0])
                kept[0] += n_open
                kept[1] += n_queued
    return {key: tuple(value) for key, value in out.items() if value != [0, 0]}


def true_counts() -> dict[tuple, tuple]:
    out: dict[tuple, list] = {}
    with scopes_disabled():
        for tenant_id, priority_id, state in Job.objects.filter(state__in=OPEN_STATES).values_list(
            "tenant_id", "priority_id", "state"
        ):
            counted = out.setdefault((tenant_id, priority_id), [0, 0])
            counted[0] += 1
            counted[1] += state == JobState.QUEUED
    return {key: tuple(value) for key, value in out.items()}


def assert_table_true(tenants):
    assert table_rows() == open_jobs()
    assert kept_counts() == true_counts()
    counts_fold()
    assert kept_counts() == true_counts()
    with scopes_disabled():
        assert not OpenJobCountChange.objects.exists()  # all folded
        assert not OpenJobCount.objects.filter(open=0, queued=0).exists()
    shown = {}
    for tenant in tenants:
        with scopes_disabled():
            ids = list(Job.objects.filter(tenant=tenant).values_list("pk", flat=True))
            counted = (
                Job.objects.filter(tenant=tenant, state__in=OPEN_STATES).count(),
                Job.objects.filter(tenant=tenant, state=JobState.QUEUED).count(),
            )
        assert job_counts(tenant) == counted
        shown.update(queue_positions(tenant=tenant, job_ids=ids))
        for one in ids:  # one job at a time, as a submit's answer asks
            assert queue_positions_page(tenant=tenant, job_ids=[one]) == queue_positions(tenant=tenant, job_ids=[one])
    assert shown == ranking()


def test_the_table_follows_every_change_of_a_job(sched, tenant, other_tenant, django_user_model):
    node = node_add("n1", 2)
    a = [submit(tenant, gpus=1) for _ in range(3)]
    b = [submit(other_tenant, gpus=0.25, priority="preemptible") for _ in range(2)]
    spec = JobSpec(kind="inference", gpu_milli=250, command=["true"])
    array = job_array_submit(tenant=other_tenant, user=None, spec=spec, array=array_parse({"count": 4}))
    assert len(table_rows()) == 5  # one record until its tasks are made
    arrays_waiting_make()  # what the next scheduling pass does first
    assert len(table_rows()) == 9
    assert_table_true([tenant, other_tenant])

    schedule_pass()  # placements: queued -> scheduled
    with scopes_disabled():
        placed = list(Job.objects.filter(state=JobState.SCHEDULED))
    assert placed and {row[4] for row in table_rows()} == {JobState.QUEUED, JobState.SCHEDULED}
    assert_table_true([tenant, other_tenant])

    now_ms = int(time.time() * 1000)
    job_started(node=node, job_id=placed[0].pk, attempt=placed[0].attempt, at_ms=now_ms)  # -> running
    assert_table_true([tenant, other_tenant])
    job_exited(node=node, job_id=placed[0].pk, attempt=placed[0].attempt, exit_code=0, at_ms=now_ms + 10)
    assert placed[0].pk not in {row[0] for row in table_rows()}  # finished: gone
    assert_table_true([tenant, other_tenant])

    job_cancel(job=a[2], reason="test")  # queued -> cancelled
    job_array_cancel(array=array)  # one UPDATE of the array's queued tasks
    assert_table_true([tenant, other_tenant])

    operator = django_user_model.objects.create(username="op", is_staff=True, is_superuser=True)
    highest = PriorityClass.objects.order_by("-rank").first()
    with scopes_disabled():
        waiting = Job.objects.filter(state=JobState.QUEUED).order_by("pk").last()
    job_priority_change(job=waiting, priority=highest, actor=operator)  # moves it up the queue
    assert_table_true([tenant, other_tenant])
    assert ranking()[waiting.pk] == 1

    with scopes_disabled():
        Job.objects.filter(pk=b[0].pk).update(submitted_at=b[0].submitted_at - timedelta(days=1))
        Job.objects.filter(state=JobState.SCHEDULED).update(state=JobState.QUEUED)  # back to the queue
        Job.objects.filter(pk=b[1].pk).update(pending_reason="rewritten")  # not a change the table follows
    assert_table_true([tenant, other_tenant])

    with scopes_disabled():
        Job.objects.filter(pk=b[0].pk).delete()
    assert b[0].pk not in {row[0] for row in table_rows()}
    assert_table_true([tenant, other_tenant])


@pytest.mark.parametrize("name", ["0006_open_jobs", "0010_open_jobs_moved_per_statement"])
def test_the_triggers_know_the_open_states_the_application_does(name):
    migration = importlib.import_module(f"scheduler.migrations.{name}")
    assert migration.OPEN == "(" + ", ".join(f"'{s}'" for s in sorted(OPEN_STATES, key=list(JobState).index)) + ")"


def test_one_statement_that_moves_many_jobs_appends_one_change_per_tenant_and_class(sched, tenant, other_tenant):
    """A bulk cancel (an array's, an operator's) or a pass placing many jobs is one UPDATE: the table of open
    jobs follows it in one statement per kind of move, so the counts get one change per (tenant, class)
    it moved, not one per job (each would be read by every admission of the tenant until the next fold)."""
    spec = JobSpec(kind="inference", gpu_milli=125, command=["true"])
    for owner in (tenant, other_tenant):
        job_array_submit(tenant=owner, user=None, spec=spec, array=array_parse({"count": 50}))
    arrays_waiting_make()
    counts_fold()
    with scopes_disabled():
        queued = list(Job.objects.filter(state=JobState.QUEUED).values_list("pk", flat=True))
        groups = set(Job.objects.filter(pk__in=queued).values_list("tenant_id", "priority_id"))
        Job.objects.filter(pk__in=queued[::2]).update(state=JobState.CANCELLED)  # open -> closed
        assert OpenJobCountChange.objects.count() == len(groups) == 2
        Job.objects.filter(pk__in=queued[1::2]).update(state=JobState.SCHEDULED)  # queued -> placed, still open
        Job.objects.filter(pk__in=queued[1::2]).update(pending_reason="rewritten")  # no move: no change
        assert OpenJobCountChange.objects.count() == 2 * len(groups)
    assert_table_true([tenant, other_tenant])


def test_the_counts_triggers_name_the_queued_state_the_application_does():
    migration = importlib.import_module("scheduler.migrations.0008_open_job_counts")
    assert "state = 'queued'" in migration.TRIGGERS and JobState.QUEUED == "queued"


@pytest.mark.parametrize("tail", [0, 3, 10_000])
def test_counts_hold_through_random_changes_and_folds(sched, tenant, other_tenant, monkeypatch, tail):
    """Random submits (lone jobs and arrays), transitions, class moves, deletions, with folds at random
    moments: the kept counts always equal the jobs', and so do admission's counts, a new job's place and
    every queued job's place as a detail and a list page show it, whether counted from the queue's end
    (kept counts less the tail) or from its head (``tail``: how many jobs at or after a job are counted
    from the end at most; 0: always from the head)."""
    import random

    from scheduler.api import selectors as api_selectors

    monkeypatch.setattr(api_selectors, "TAIL_COUNTED", tail)

    from scheduler.services import job_insert
    from tests.scheduler.test_job_insert import new_job

    rng = random.Random(7)
    classes = list(PriorityClass.objects.order_by("rank"))
    tenants = [tenant, other_tenant]
    for step in range(120):
        move = rng.random()
        with scopes_disabled():
            jobs = list(Job.objects.order_by("pk").values_list("pk", "state"))
            if move < 0.35 or not jobs:
                owner = rng.choice(tenants)
                job = job_insert(new_job(owner, None, priority=rng.choice(classes)))
                assert job.api_queue_position == ranking()[job.pk], step
            elif move < 0.45:
                spec = JobSpec(kind="inference", gpu_milli=250, command=["true"])
                job_array_submit(tenant=rng.choice(tenants), user=None, spec=spec, array=array_parse({"count": 3}))
                arrays_waiting_make()
            elif move < 0.5:  # one statement moving many jobs, of both tenants, some of them nowhere
                picked = [pk for pk, _ in rng.sample(jobs, min(len(jobs), rng.randint(2, 12)))]
                Job.objects.filter(pk__in=picked).update(state=rng.choice(list(JobState)))
            elif move < 0.85:
                pk, _ = rng.choice(jobs)
                state = rng.choice([JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.PREEMPTED,
                                    JobState.SUCCEEDED, JobState.CANCELLED])  # fmt: skip
                Job.objects.filter(pk=pk).update(state=state)
            elif move < 0.93:
                pk, _ = rng.choice(jobs)
                Job.objects.filter(pk=pk).update(priority=rng.choice(classes))
            else:
                Job.objects.filter(pk=rng.choice(jobs)[0]).delete()
        if rng.random() < 0.2:
            counts_fold()
        assert kept_counts() == true_counts(), step
        for owner in tenants:
            with scopes_disabled():
                counted = (
                    Job.objects.filter(tenant=owner, state__in=OPEN_STATES).count(),
                    Job.objects.filter(tenant=owner, state=JobState.QUEUED).count(),
                )
            assert job_counts(owner) == counted, step
        if step % 10 == 0:
            places = ranking()
            for owner in tenants:
                with scopes_disabled():
                    ids = list(Job.objects.filter(tenant=owner).values_list("pk", flat=True))
                mine = {pk: place for pk, place in places.items() if pk in ids}
                assert queue_positions_page(tenant=owner, job_ids=ids) == mine, step
                assert queue_positions(tenant=owner, job_ids=ids) == mine, step


@pytest.mark.django_db(transaction=True)
def test_the_pass_clears_the_change_tables_dead_rows_once_enough_were_folded(sched, tenant, monkeypatch):
    """Every fold deletes the changes it read; their dead rows would be read by every count until a VACUUM.
    The pass VACUUMs the table itself (scheduler.counts.changes_vacuum), after its transaction, once
    CHANGES_VACUUM_AFTER changes were folded: the table's pages are then empty and given back."""
    from scheduler import counts, passes
    from scheduler.tasks import schedule_pass_task

    monkeypatch.setattr(passes, "pass_request", lambda **kwargs: None)  # only the passes run here fold

    def pages() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_relation_size(%s)", [OpenJobCountChange._meta.db_table])
            return cursor.fetchone()[0]

    monkeypatch.setattr(counts, "CHANGES_VACUUM_AFTER", 30)
    monkeypatch.setattr(counts, "_folded_since_vacuum", [0])
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM {OpenJobCountChange._meta.db_table}")
    for _ in range(20):  # a change each, folded by the pass: not enough yet
        submit(tenant, gpus=0.125)
    schedule_pass_task()
    assert pages() > 0 and counts._folded_since_vacuum[0] == 20
    for _ in range(20):
        submit(tenant, gpus=0.125)
    schedule_pass_task()  # 40 folded: the dead rows are cleared and the table's pages given back
    assert pages() == 0 and counts._folded_since_vacuum[0] == 0
    assert kept_counts() == true_counts()
    with scopes_disabled():  # inside a transaction VACUUM cannot run: nothing is tried
        from django.db import transaction

        with transaction.atomic():
            assert counts.changes_vacuum(10_000) is False


def test_no_statement_a_submit_or_a_list_prepares_reads_the_change_table_itself(sched, tenant):
    """The pass VACUUMs the change table every few hundred folds, and a VACUUM invalidates every cached plan
    that reads the table, on every connection: the reads of the kept counts go through functions (migration
    0011), so admission's read, the insert with its queue position and a page's positions keep their plans."""
    first = submit(tenant, gpus=0.125)
    job_array_submit(tenant=tenant, user=None, spec=JobSpec(kind="inference", gpu_milli=125, command=["true"]),
                     array=array_parse({"count": 3}))  # fmt: skip
    assert queue_positions_page(tenant=tenant, job_ids=[first.pk]) == {first.pk: 1}
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [text for (text,) in cursor.fetchall()]
    assert any("scheduler_tenant_open_counts(" in text for text in prepared)  # admission's read
    assert any("scheduler_queued_in(" in text for text in prepared)  # a queue position
    assert not [text for text in prepared if OpenJobCountChange._meta.db_table in text]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "count_sql",
    ["(scheduler_tenant_open_counts(%(tenant)s)).queued", "scheduler_queued_in(ARRAY[%(priority)s]::bigint[])"],
)
def test_a_kept_count_is_read_in_the_snapshot_of_the_statement_that_asks(count_sql):
    """The count functions are STABLE: a count asked twice in one statement is the same, though a change
    commits in between (so a count sees a fold wholly or not at all, as when the tables were read inline).
    A VOLATILE function would take a snapshot per query and see the change the second time."""
    import threading

    import psycopg2

    ids = {"tenant": -7, "priority": -7}  # no such tenant or class: only this test's rows (no foreign keys)
    changes = OpenJobCountChange._meta.db_table
    other = psycopg2.connect(**connection.get_connection_params())
    other.autocommit = True

    def change() -> None:
        time.sleep(0.15)
        with other.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {changes} (tenant_id, priority_id, open, queued) VALUES (%(tenant)s, %(priority)s, 1, 1)",
                ids,
            )

    try:
        writer = threading.Thread(target=change)
        writer.start()
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {count_sql}, pg_sleep(0.5) IS NOT NULL, {count_sql}", ids)
            before, slept, after = cursor.fetchone()
        writer.join()
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {count_sql}", ids)
            (now,) = cursor.fetchone()
    finally:
        with other.cursor() as cursor:
            cursor.execute(f"DELETE FROM {changes} WHERE tenant_id = %(tenant)s", ids)
        other.close()
    assert slept and (before, after, now) == (0, 0, 1)
