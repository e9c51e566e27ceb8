"""Writes for job arrays: submit an array as one record, make its tasks, cancel them as a group.

Each task is an ordinary :class:`~scheduler.models.Job` (placed, run, metered and
billed on its own, cancellable one by one) with ``array`` and ``array_index``;
the agent gets the index as ``$GPUSHARE_ARRAY_INDEX``. As in Slurm, the submit
stores only the array (one row, admitted as a whole) and the task rows are made
off the request path: the next scheduling pass makes them, or the first read or
cancel of the array's tasks, whichever comes first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant
from accounts.tenancy import acts_for_tenant, tenant_scope
from gpushare.prepared import columns_sql, insert_parts, inserted_if, model_insert

from .admission import Write
from .arrays import ArraySpec, range_parse
from .models import TRANSITIONS, Job, JobArray, JobEvent, JobState
from .passes import rows_insert
from .services import (
    EVENT_COLUMNS,
    JobSpec,
    admission_check,
    admitted_again_once,
    job_cancel,
    job_checked_again,
    job_row_fields,
    job_shape,
    rules_unchanged_sql,
    schedule_soon,
)

CANCELLABLE_AT_ONCE = (JobState.QUEUED, JobState.PREEMPTED)
assert all(JobState.CANCELLED in TRANSITIONS[state] for state in CANCELLABLE_AT_ONCE)
EVENT_FIELDS = tuple(EVENT_COLUMNS.split(", "))  # a timeline event's columns, as rows_insert takes them


WAITING_FOR_A_PASS = "waiting for the next scheduling pass"


@admitted_again_once
@transaction.atomic
def job_array_submit(
    *, tenant: Tenant, user, spec: JobSpec, array: ArraySpec, idempotency: tuple = ("", "")
) -> JobArray:
    """Store the array, admitted as a whole (all its tasks are admitted, or none), as one record: like
    Slurm, the task rows are made later, off the request path (``array_tasks_make``: the next scheduling
    pass, which this asks for, or the first read or cancel that needs them). The insert goes with
    admission's read under its locks when admission can send it (one round trip)."""
    mode, priority = job_shape(tenant=tenant, spec=spec, hinted=True)
    key, digest = idempotency
    with tenant_scope(tenant):
        job_array = JobArray(
            tenant=tenant,
            submitted_by=user if getattr(user, "pk", None) else None,
            name=spec.name,
            indices=array.expression,
            task_count=array.count,
            idempotency_key=key,
            request_hash=digest,
            tasks_made=False,
            task_spec={  # what every task shares, by Job attname, until the tasks are made
                "kind": spec.kind,
                "mode": mode,
                "gpu_milli": spec.gpu_milli,
                "command": list(spec.command),
                "env": dict(spec.env),
                "image": spec.image,
                "gpu_model": spec.gpu_model,
                "gpu_memory_mb": spec.gpu_memory_mb,
                "priority_id": priority.pk,
                "max_runtime_s": spec.runtime_with(priority),
            },
        )
        condition, params = rules_unchanged_sql(), (priority.rules_key,) * 2
        written = admission_check(
            tenant=tenant,
            spec=spec,
            mode=mode,
            priority=priority,
            count=array.count,
            write=lambda: _array_write(job_array, condition=condition, params=params),
        )
        if written is not None:
            done = inserted_if(job_array, written[0])
        else:  # not sent with admission's read
            done = model_insert(job_array, condition=condition, params=params) is not None
        if not done:
            # The classes or settings changed since this process read the class (as job_submit).
            priority = job_checked_again(tenant=tenant, spec=spec, count=array.count)
            job_array.task_spec.update(priority_id=priority.pk, max_runtime_s=spec.runtime_with(priority))
            model_insert(job_array)
    schedule_soon(submitted=True)
    return job_array


def _array_write(job_array: JobArray, *, condition: str, params: tuple) -> Write:
    """The array's insert, for admission to send with its read (``admission.Write``)."""
    sql, values = insert_parts(job_array, condition=condition, params=params)
    return Write(f"a AS ({sql})", "SELECT a.id AS id FROM a", ("id",), values)


@acts_for_tenant("array")
@transaction.atomic
def array_tasks_make(*, array: JobArray) -> int:
    """Make ``array``'s task rows now if the scheduler has not yet (a read or a cancel that needs them);
    how many were made. Waits for a pass that is making them, then finds nothing to do."""
    if array.tasks_made:
        return 0
    made = sum(
        _tasks_make(found) for found in JobArray.objects.select_for_update().filter(pk=array.pk, tasks_made=False)
    )
    array.tasks_made, array.task_spec = True, {}
    return made


@scopes_disabled()  # the scheduling pass: every tenant's arrays
@transaction.atomic
def arrays_waiting_make() -> int:
    """Make the task rows of every array still waiting for them, oldest first; how many tasks were made.
    An array another transaction is making (a read, a cancel) is left to it."""
    waiting = (
        JobArray.objects.select_for_update(skip_locked=True).filter(tasks_made=False).order_by("submitted_at", "id")
    )
    return sum(_tasks_make(found) for found in waiting)


def _tasks_make(array: JobArray) -> int:
    """The tasks of ``array`` (locked, not made yet) as queued jobs with the array's submission time, so
    each keeps its place in the queue, and their "submitted" events; the array marked made."""
    template = Job(
        tenant_id=array.tenant_id,
        submitted_by_id=array.submitted_by_id,
        array_id=array.pk,
        name=array.name,
        pending_reason=WAITING_FOR_A_PASS,
        submitted_at=array.submitted_at,
        **array.task_spec,
    )
    # One submission time for the whole array; the id orders the tasks within it (index order).
    task_ids = tasks_insert(template, range_parse(array.indices).indices)
    submitted_events_insert(tenant_id=array.tenant_id, at=array.submitted_at, job_ids=task_ids)
    JobArray.objects.filter(pk=array.pk).update(tasks_made=True, task_spec={})
    return len(task_ids)


def tasks_insert(template: Job, indices) -> list[int]:
    """Insert one job per index, copies of ``template`` but for ``array_index``; their ids in index order.

    PostgreSQL: the template's values are sent once, read from the model's own fields and defaults (so
    a column added to Job later is covered), and the server makes one row per element of the index
    array (``INSERT ... SELECT ... FROM unnest(...)``): for 1,000 tasks ~15 ms, where sending 1,000 rows
    of values cost ~60-130 ms, most of it building them in Python. Elsewhere bulk_create.
    """
    indices = list(indices)
    fields = job_row_fields(but=("array_index",))
    for f in fields:
        if getattr(f, "auto_now_add", False) and getattr(template, f.attname) is None:
            setattr(template, f.attname, timezone.now())
    if connection.vendor != "postgresql":
        values = {f.attname: getattr(template, f.attname) for f in fields}
        tasks = [Job(**{**values, "array_index": i}) for i in indices]
        return [t.pk for t in Job.objects.bulk_create(tasks, batch_size=500)]
    quote = connection.ops.quote_name
    columns = columns_sql(fields)
    # Cast each value to its column's type: the SELECT list, unlike VALUES, does not take it from the target.
    values = ", ".join(f"%s::{f.cast_db_type(connection)}" for f in fields)
    sql = (
        f"INSERT INTO {quote(Job._meta.db_table)} ({columns}, {quote('array_index')}) "
        f"SELECT {values}, t.i FROM unnest(%s::integer[]) WITH ORDINALITY AS t(i, n) ORDER BY t.n "
        f"RETURNING id, {quote('array_index')}"
    )
    params = [f.get_db_prep_save(getattr(template, f.attname), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, indices])
        id_of = {index: pk for pk, index in cursor.fetchall()}
    return [id_of[i] for i in indices]


def submitted_events_insert(*, tenant_id: int, at, job_ids: list[int]) -> None:
    """The "submitted" event of each new task, made by the server from the list of ids."""
    if connection.vendor != "postgresql":
        rows_insert(
            JobEvent,
            EVENT_FIELDS,
            [(tenant_id, job_id, at, "", JobState.QUEUED, "submitted") for job_id in job_ids],
        )
        return
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {JobEvent._meta.db_table} ({EVENT_COLUMNS}) "
            "SELECT %s, j, %s, '', %s, 'submitted' FROM unnest(%s::bigint[]) AS j",
            [tenant_id, at, JobState.QUEUED, job_ids],
        )


@dataclass(frozen=True)
class ArraySubmitted:
    array: JobArray
    created: bool


def job_array_submit_idempotent(
    *, tenant: Tenant, user, spec: JobSpec, array: ArraySpec, idempotency_key: str
) -> ArraySubmitted:
    """``job_array_submit`` once per (tenant, Idempotency-Key), like single jobs (scheduler.api.idempotency)."""
    from .api.idempotency import key_holder, once_per_key, request_hash

    if not idempotency_key:
        return ArraySubmitted(job_array_submit(tenant=tenant, user=user, spec=spec, array=array), True)
    digest = hashlib.sha256(f"{request_hash(spec)}:{array.expression}".encode()).hexdigest()

    keyed = (idempotency_key, digest)
    job_array, created = once_per_key(
        lambda: job_array_submit(tenant=tenant, user=user, spec=spec, array=array, idempotency=keyed),
        lambda: key_holder(JobArray, tenant=tenant, key=idempotency_key, digest=digest, noun="array"),
    )
    return ArraySubmitted(job_array, created)


@acts_for_tenant("array")
@transaction.atomic
def job_array_cancel(*, array: JobArray, actor=None, reason: str = "") -> int:
    """Cancel every unfinished task: queued ones at once (in bulk), placed or running ones
    gracefully (as ``job_cancel`` does: signal, grace period). Returns how many were asked to stop."""
    who = getattr(actor, "username", "") or "the platform"
    reason = reason or f"array {array.pk} cancelled by {who}"
    array_tasks_make(array=array)  # each task ends cancelled, with its own record, as if it had been made
    cancelled = _waiting_cancel(array, reason=reason)
    placed = list(Job.objects.filter(array=array, state__in=(JobState.SCHEDULED, JobState.RUNNING), stop_requested=""))
    for job in placed:
        job_cancel(job=job, actor=actor, reason=reason)
    return cancelled + len(placed)


def _waiting_cancel(array: JobArray, *, reason: str) -> int:
    """Cancel the array's tasks that wait (queued, preempted), each with its "cancelled" event; how many.

    PostgreSQL: one statement (the tasks locked, updated, and their events written from the old states),
    not 1,000 ids read into Python and 1,000 events built there: a 1,000-task group cancel through the API
    took 67-107 ms, 103-134 ms before (docs/benchmarks.md, session 23). Elsewhere the ORM."""
    now, stop_reason, detail = timezone.now(), reason[:200], reason[:300]  # as long as their columns
    if connection.vendor != "postgresql":
        waiting = list(
            Job.objects.select_for_update()
            .filter(array=array, state__in=CANCELLABLE_AT_ONCE)
            .values_list("pk", "state")
        )
        Job.objects.filter(pk__in=[pk for pk, _ in waiting]).update(
            state=JobState.CANCELLED, finished_at=now, stop_reason=stop_reason
        )
        rows_insert(
            JobEvent,
            EVENT_FIELDS,
            [(array.tenant_id, pk, now, state, JobState.CANCELLED, detail) for pk, state in waiting],
        )
        return len(waiting)
    jobs, events = Job._meta.db_table, JobEvent._meta.db_table
    with connection.cursor() as cursor:
        # The lock (and READ COMMITTED's recheck of a task changed meanwhile) is the first CTE's; the update
        # joins its rows, so each event's from_state is the state the task was cancelled from.
        cursor.execute(
            f"""WITH waiting AS (SELECT id, state FROM {jobs} WHERE array_id = %s AND state = ANY(%s) FOR UPDATE),
                     done AS (UPDATE {jobs} j SET state = %s, finished_at = %s, stop_reason = %s
                                FROM waiting w WHERE j.id = w.id RETURNING j.id, w.state AS was)
                INSERT INTO {events} ({EVENT_COLUMNS}) SELECT %s, id, %s, was, %s, %s FROM done""",
            [
                array.pk,
                list(CANCELLABLE_AT_ONCE),
                JobState.CANCELLED,
                now,
                stop_reason,
                array.tenant_id,
                now,
                JobState.CANCELLED,
                detail,
            ],
        )
        return cursor.rowcount
