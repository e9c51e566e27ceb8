"""Every write to jobs goes through here. Each service is one transaction.

Messages to node agents (launch, stop) are sent after commit, so a pass that
crashes never leaves a job half-placed or a launch for a rolled-back row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant
from accounts.tenancy import acts_for_tenant, tenant_scope
from agents.agent.imageref import image_check
from agents.models import Node
from gpushare.after_response import after_response
from gpushare.prepared import ServerStatement, columns_sql, insert_values, inserted, model_columns_sql, model_from_row
from webhooks import emit as webhook_emit

from . import admission
from .admission import Write
from .counts import queued_ahead_sql
from .models import (
    ACTIVE_STATES,
    MILLI_PER_GPU,
    TERMINAL_STATES,
    TRANSITIONS,
    Allocation,
    Job,
    JobEvent,
    JobKind,
    JobLogChunk,
    JobMode,
    JobState,
    PriorityClass,
    SchedulerSettings,
)

log = logging.getLogger(__name__)

SLICE_MILLI = frozenset({125, 250, 500})
MAX_GPUS_PER_JOB = 8


class JobError(Exception):
    """A request the rules refuse; ``code`` is the API's machine-readable code."""

    def __init__(self, message: str, *, code: str = "invalid", field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field


class AdmitAgain(JobError):
    """A submit admitted side by side with others (far from its limits, it seemed) found its tenant
    near a limit once it held the lock: it is run again, and admitted exactly (see ``admission/``)."""

    def __init__(self, message: str):
        super().__init__(message, code="conflict")


def admitted_again_once(submit):
    """Run ``submit`` (a whole transaction) once more when its admission asks for it (``AdmitAgain``).
    Inside a caller's transaction the first admission's lock stays held until that one ends, so the
    caller gets the error (the API's 409: retry)."""

    @functools.wraps(submit)
    def run(**kwargs):
        try:
            return submit(**kwargs)
        except AdmitAgain:
            if transaction.get_connection().in_atomic_block:
                raise
            return submit(**kwargs)

    return run


def ms_to_dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def dt_to_ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


@dataclass(frozen=True)
class JobSpec:
    kind: str
    gpu_milli: int
    command: list[str]
    name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    image: str = ""
    gpu_model: str = ""
    gpu_memory_mb: int | None = None
    priority: str = ""
    max_runtime_s: int | None = None
    endpoint_id: int | None = None  # a replica of this endpoint (its endpoint's money hold covers it)

    def runtime_with(self, priority: PriorityClass) -> int:
        """The job's max runtime: the one asked for, else the class's default (the settings' default)."""
        return self.max_runtime_s or priority.default_max_runtime_s


def rules_key_sql() -> str:
    """An expression that changes whenever a priority class or the scheduler settings change: every
    class's id and row version (``xmin``), and the settings row's. A class read with one key is still
    what a submit would read as long as the key is equal (a frozen row's ``xmin`` also changes it:
    a needless look again, never a stale class)."""
    if connection.vendor != "postgresql":  # no row versions (the SQLite demo): never a hint (priority_hinted)
        return "CAST(NULL AS TEXT)"
    classes, conf = PriorityClass._meta.db_table, SchedulerSettings._meta.db_table
    return (
        f"(coalesce((SELECT string_agg(k.id || ':' || k.xmin::text, ',' ORDER BY k.id) FROM {classes} k), '')"
        f" || '|' || coalesce((SELECT k.xmin::text FROM {conf} k WHERE k.id = 1), ''))"
    )


def rules_unchanged_sql() -> str:
    """A condition on two parameters, both a class's ``rules_key`` (or both None: nothing to check)."""
    return f"(%s::text IS NULL OR {rules_key_sql()} = %s::text)"


@functools.cache
def _priority_statement() -> ServerStatement:
    columns = model_columns_sql(PriorityClass, "c")
    return ServerStatement(
        f"""SELECT {columns},
                   COALESCE((SELECT s.default_max_runtime_s FROM {SchedulerSettings._meta.db_table} s WHERE s.id = 1),
                            %(default_runtime)s),
                   {rules_key_sql()}
              FROM {PriorityClass._meta.db_table} c
             WHERE c.name = %(name)s OR %(name)s = ''
             ORDER BY c.default_for_kind = %(kind)s DESC,
                      CASE WHEN c.default_for_kind = %(kind)s THEN -c.rank ELSE c.rank END, c.id
             LIMIT 1"""
    )


def priority_for(*, kind: str, name: str = "") -> PriorityClass:
    """The class named ``name``, else the highest class that is the default for ``kind``, else the lowest
    class. One statement, planned once per connection (the ORM spent ~1.5 ms building it on every submit);
    the class also carries ``default_max_runtime_s``, the scheduler settings' default runtime."""
    default_runtime = settings.GPUSHARE["DEFAULT_MAX_RUNTIME_S"]
    with connection.cursor() as cursor:
        _priority_statement().execute(cursor, {"default_runtime": default_runtime, "name": name, "kind": kind})
        row = cursor.fetchone()
    if row is None and name:
        known = ", ".join(PriorityClass.objects.values_list("name", flat=True)) or "none defined"
        raise JobError(f"unknown priority class '{name}' (known: {known})", field="priority")
    if row is None:
        raise JobError("the operator has not defined any priority class yet", code="conflict")
    found = model_from_row(PriorityClass, row)
    found.default_max_runtime_s, found.rules_key = row[-2], row[-1]
    return found


# (kind, name, the default runtime setting) -> the class priority_for answered, with its rules key: what
# this process's next single submit of that shape uses instead of the statement (one round trip less).
# Only a hint: the submit's insert writes the job only while the rules key is still equal, and looks
# again when it is not (job_submit). Unknown names are never kept (they raise), so it stays small.
_class_hints: dict[tuple[str, str, int], PriorityClass] = {}


def _hint_key(kind: str, name: str) -> tuple[str, str, int]:
    return kind, name, settings.GPUSHARE["DEFAULT_MAX_RUNTIME_S"]


def priority_hinted(*, kind: str, name: str = "") -> PriorityClass:
    """:func:`priority_for`, from this process's hint when it has one (the instance is shared: read it,
    never change it). Only for a write that checks ``rules_key`` itself (``job_insert``)."""
    key = _hint_key(kind, name)
    hint = _class_hints.get(key)
    if hint is None or connection.vendor != "postgresql":
        hint = _class_hints[key] = priority_for(kind=kind, name=name)
    return hint


def job_mode_for(*, kind: str, gpu_milli: int) -> str:
    if gpu_milli % MILLI_PER_GPU == 0:
        return JobMode.DEDICATED
    if kind != JobKind.INFERENCE:
        raise JobError("training jobs take whole GPUs: gpus must be an integer from 1 to 8", field="gpus")
    if gpu_milli not in SLICE_MILLI:
        raise JobError("a shared slice is 0.125, 0.25 or 0.5 of a GPU", field="gpus")
    return JobMode.SHARED


def job_transition(job: Job, to_state: str, detail: str = "", *, save_fields: tuple[str, ...] = ()) -> None:
    """Move ``job`` to ``to_state`` if the state machine allows it, and record it."""
    if to_state not in TRANSITIONS[job.state]:
        raise JobError(f"a {job.state} job cannot become {to_state}", code="conflict")
    from_state = job.state
    job.state = to_state
    job.save(update_fields=["state", *save_fields])
    JobEvent.objects.create(tenant_id=job.tenant_id, job=job, from_state=from_state, to_state=to_state, detail=detail)
    webhook_emit.job_state_changed(job, from_state=from_state, detail=detail)


def schedule_soon(*, submitted: bool = False) -> None:
    """Ask for a scheduling pass once the current transaction commits (coalesced with one already queued)
    and, in a request, once its response is sent (``gpushare.after_response``: the client does not wait
    for the trigger); ``submitted``: only new jobs ask (``passes.pass_request``)."""
    from .passes import pass_request

    transaction.on_commit(lambda: after_response(lambda: pass_request(submitted=submitted)))


def admission_check(
    *,
    tenant: Tenant,
    spec: JobSpec,
    mode: str,
    priority: PriorityClass,
    count: int = 1,
    write: Callable[[], Write] | None = None,
) -> tuple | None:
    """Limits and money holds for ``count`` jobs of this shape, as a whole, inside the caller's transaction.

    The admission layer (``admission/``, above the scheduler) answers through the port it provides at
    start-up; it locks the tenant's admissions until commit, so concurrent submits cannot pass a limit
    or a budget together. Without a provider this raises (``ImproperlyConfigured``): never "no limits".
    ``write``: makes the submit's insert, which admission may send with its read (``admission.Write``):
    what it answered, or None when it was not sent (the caller writes).
    """
    return admission.job_admit(
        tenant=tenant,
        ask=admission.JobAsk(
            kind=spec.kind,
            mode=mode,
            gpu_milli=spec.gpu_milli,
            max_runtime_s=spec.runtime_with(priority),
            price_multiplier=priority.price_multiplier,
            gpu_model=spec.gpu_model,
            count=count,
            endpoint_id=spec.endpoint_id,
        ),
        write=write,
    )


def job_shape(*, tenant: Tenant, spec: JobSpec, hinted: bool = False) -> tuple[str, PriorityClass]:
    """The job's mode and priority class, from its spec and the classes (raises JobError): what is checked
    before admission. ``hinted``: the class may be this process's hint (``priority_hinted``), for a caller
    whose write checks its ``rules_key``."""
    if tenant.state != Tenant.State.ACTIVE:
        raise JobError(f"tenant {tenant.slug} is {tenant.state} and cannot submit jobs", code="forbidden")
    if spec.image:
        problem = image_check(spec.image, settings.GPUSHARE.get("ALLOWED_REGISTRIES", ()))
        if problem:
            raise JobError(problem, field="image")
    mode = job_mode_for(kind=spec.kind, gpu_milli=spec.gpu_milli)
    if mode == JobMode.DEDICATED and not 1 <= spec.gpu_milli // MILLI_PER_GPU <= MAX_GPUS_PER_JOB:
        raise JobError(f"a job takes 1 to {MAX_GPUS_PER_JOB} whole GPUs on one node", field="gpus")
    lookup = priority_hinted if hinted else priority_for
    return mode, lookup(kind=spec.kind, name=spec.priority)


def job_checked(*, tenant: Tenant, spec: JobSpec, count: int = 1, hinted: bool = False) -> tuple[str, PriorityClass]:
    """The job's mode and priority class once the tenant may submit ``count`` such jobs (raises JobError):
    ``job_shape``, then ``admission_check``."""
    mode, priority = job_shape(tenant=tenant, spec=spec, hinted=hinted)
    admission_check(tenant=tenant, spec=spec, mode=mode, priority=priority, count=count)
    return mode, priority


def job_checked_again(*, tenant: Tenant, spec: JobSpec, count: int = 1) -> PriorityClass:
    """The class read again and the job(s) admitted again with it, for a write that found the class's
    ``rules_key`` out of date (the first admission's locks are this transaction's: no wait for itself)."""
    _class_hints.pop(_hint_key(spec.kind, spec.priority), None)
    return job_checked(tenant=tenant, spec=spec, count=count, hinted=True)[1]


# The columns of a job's timeline event, as the raw inserts of a submit write them (job_insert, tasks).
EVENT_COLUMNS = "tenant_id, job_id, at, from_state, to_state, detail"


def job_row_fields(*, but: tuple[str, ...] = ()) -> list:
    """The fields a new job's row is written from: all but the id (and ``but``), as ``Model.save()`` writes
    them, so a column added to Job later is covered by the raw inserts."""
    return [f for f in Job._meta.concrete_fields if not f.primary_key and f.attname not in but]


JOB_WRITTEN = ("id", "position", "hooks")  # the insert's SELECT: the id, queue position, active webhooks


@functools.cache
def _job_insert_parts() -> tuple[list, str, str]:
    """:func:`job_row_fields`, and the WITH items and the SELECT of the statement that writes a job with its
    "submitted" event and answers ``JOB_WRITTEN``."""
    fields = job_row_fields()
    quote = connection.ops.quote_name
    # The position: every queued job of its class and the classes above it is ahead of a job submitted now
    # (scheduler.counts: per-class counts, not a count of the queue), plus one. The statement's snapshot
    # holds every other job, not this one (its count change is the triggers', after the statement). What
    # queue_positions_page answers once committed, short of jobs committed by others in between.
    # The row is written only while the priority classes and settings are as the job's class was read
    # (``rules_key``; NULL: read in this transaction, nothing to check); no row back means they changed.
    ctes = (
        f"j AS (INSERT INTO {quote(Job._meta.db_table)} ({columns_sql(fields)}) "
        f"SELECT {', '.join(['%s'] * len(fields))} WHERE {rules_unchanged_sql()} "
        "RETURNING id, tenant_id, submitted_at, priority_id), "
        f"e AS (INSERT INTO {quote(JobEvent._meta.db_table)} ({EVENT_COLUMNS}) "
        "SELECT tenant_id, id, submitted_at, '', %s, 'submitted' FROM j RETURNING job_id)"
    )
    position, hooks = queued_ahead_sql("j.priority_id"), webhook_emit.active_hooks_sql("j.tenant_id")
    select = f"SELECT j.id AS id, 1 + {position} AS position, {hooks} AS hooks FROM j JOIN e ON e.job_id = j.id"
    return fields, ctes, select


@functools.cache
def _job_insert_statement() -> ServerStatement:
    _, ctes, select = _job_insert_parts()
    return ServerStatement(f"WITH {ctes} {select}")


def job_insert_write(job: Job, *, rules_key: str | None) -> Write:
    """:func:`job_insert`'s statement for ``job``, for admission to send with its read (``admission.Write``);
    what it answers goes to :func:`job_written`."""
    _, ctes, select = _job_insert_parts()
    return Write(ctes, select, JOB_WRITTEN, tuple(_job_insert_values(job, rules_key=rules_key)))


def _job_insert_values(job: Job, *, rules_key: str | None) -> list:
    """The values of the insert's ``%s``, in order: the job's fields, the rules key twice, the event's state."""
    fields = _job_insert_parts()[0]
    return [*insert_values(job, fields), rules_key, rules_key, JobState.QUEUED]


def job_written(job: Job, row) -> Job | None:
    """``job`` as its insert left it (``row``: ``JOB_WRITTEN``): its id, its queue position as the API shows
    it (``api_queue_position``: no query of its own for the answer) and the tenant's active webhooks
    (``active_hooks``: the "submitted" event needs no query of its own); None when nothing was written
    (the classes or settings changed since its class was read)."""
    if row is None or row[0] is None:
        return None
    pk, job.api_queue_position, hooks = row
    inserted(job, pk)
    job.active_hooks = webhook_emit.active_hooks_from(hooks)
    return job


def job_insert(job: Job, *, rules_key: str | None = None) -> Job | None:
    """Write a new queued ``job`` and its "submitted" event (:func:`job_written`).

    On PostgreSQL one statement, the values prepared by the model's own fields as ``save()`` would
    (``pre_save``: ``submitted_at``): the ORM spent ~1.5 ms of CPU per submit building two inserts, and
    the position asked afterwards was a statement of its own (~0.6 ms, half of it planning) that counted
    the queue ahead. Planned once per connection (``ServerStatement``): planning it cost more than running it.
    Elsewhere (the SQLite demo) ``save()`` and a ``create()``.

    ``rules_key``: the key the job's class was read with (``priority_hinted``); nothing is written, and
    None answered, when the classes or settings have changed since.
    """
    if connection.vendor != "postgresql":
        job.save(force_insert=True)
        JobEvent.objects.create(tenant_id=job.tenant_id, job=job, to_state=JobState.QUEUED, detail="submitted")
        return job
    with connection.cursor() as cursor:
        _job_insert_statement().execute(cursor, _job_insert_values(job, rules_key=rules_key))
        return job_written(job, cursor.fetchone())


@admitted_again_once
@transaction.atomic
def job_submit(*, tenant: Tenant, user, spec: JobSpec, idempotency: tuple[str, str] = ("", "")) -> Job:
    """Admit and write one queued job. ``idempotency``: (Idempotency-Key, request digest), written with the
    row by its own insert (``scheduler.api.idempotency``: a key already used fails on its unique index).
    The insert goes with admission's read under its locks when admission can send it (one round trip)."""
    mode, priority = job_shape(tenant=tenant, spec=spec, hinted=True)
    key, digest = idempotency
    with tenant_scope(tenant):
        job = Job(
            tenant=tenant,
            submitted_by=user if getattr(user, "pk", None) else None,
            name=spec.name,
            kind=spec.kind,
            mode=mode,
            gpu_milli=spec.gpu_milli,
            command=list(spec.command),
            env=dict(spec.env),
            image=spec.image,
            gpu_model=spec.gpu_model,
            gpu_memory_mb=spec.gpu_memory_mb,
            priority=priority,
            max_runtime_s=spec.runtime_with(priority),
            pending_reason="waiting for the next scheduling pass",
            idempotency_key=key,
            request_hash=digest,
        )
        write = functools.partial(job_insert_write, job, rules_key=priority.rules_key)
        written = admission_check(tenant=tenant, spec=spec, mode=mode, priority=priority, write=write)
        done = job_written(job, written) if written is not None else job_insert(job, rules_key=priority.rules_key)
        if done is None:
            # The classes or settings changed since this process read the job's class: read it again and
            # admit the job with it (the first admission's locks are this transaction's: no wait for itself).
            job.priority = priority = job_checked_again(tenant=tenant, spec=spec)
            job.max_runtime_s = spec.runtime_with(priority)
            job_insert(job)
        webhook_emit.job_state_changed(
            job, from_state=None, detail="submitted", active_hooks=getattr(job, "active_hooks", None)
        )
    schedule_soon(submitted=True)
    return job


def schedule_pass(*, now=None):
    """One scheduling pass (see :mod:`scheduler.passes`)."""
    from .passes import schedule_pass as run

    return run(now=now)


def _send_to_node(node_name: str, task: str, payload: dict) -> None:
    from agents.dispatch import node_send

    node_send(node_name, task, payload)


def _job_for_node(node: Node, job_id: int, attempt: int | None) -> Job | None:
    job = Job.objects.select_for_update().filter(pk=job_id).first()
    if job is None or job.node_id != node.pk:
        log.warning("node %s reported job %s that it does not hold; ignored", node.name, job_id)
        return None
    if attempt is not None and attempt != job.attempt:
        log.info("node %s reported attempt %s of job %s (now %s); ignored", node.name, attempt, job_id, job.attempt)
        return None
    return job


@scopes_disabled()  # a node's report: the job is found by id and checked against the node
@transaction.atomic
def job_started(*, node: Node, job_id: int, attempt: int | None, at_ms: int) -> None:
    job = _job_for_node(node, job_id, attempt)
    if job is None or job.state != JobState.SCHEDULED:
        return
    job.started_at = ms_to_dt(at_ms)
    job_transition(job, JobState.RUNNING, f"started on {node.name}", save_fields=("started_at",))


def _final_state(job: Job, exit_code: int | None) -> str:
    return {
        "cancel": JobState.CANCELLED,
        "preempt": JobState.PREEMPTED,
        "move": JobState.PREEMPTED,  # moved off its GPUs (defragmentation): queued again at once
    }.get(job.stop_requested, JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED)


def allocations_release(job: Job, *, at=None) -> None:
    Allocation.objects.filter(job=job, released_at__isnull=True).update(released_at=at or timezone.now())


@scopes_disabled()  # a node's report: the job is found by id and checked against the node
@transaction.atomic
def job_exited(
    *,
    node: Node,
    job_id: int,
    attempt: int | None,
    exit_code: int | None,
    at_ms: int,
    reason: str = "",
    lost: bool = False,
) -> None:
    """The agent saw the job's processes end (and the GPU free of them).

    ``lost`` means the agent ended the job for its own reasons (shutting
    down, the job was not running there): it is lost, not failed.
    """
    job = _job_for_node(node, job_id, attempt)
    if job is None or job.state not in ACTIVE_STATES:
        return
    job.finished_at = ms_to_dt(at_ms)
    if job.started_at is None:
        job.started_at = job.finished_at
    job.exit_code = exit_code
    job.stop_reason = reason or job.stop_reason
    final = JobState.LOST if lost and not job.stop_requested else _final_state(job, exit_code)
    detail = reason or (f"exit code {exit_code}" if exit_code is not None else "ended")
    fields = ("finished_at", "started_at", "exit_code", "stop_reason")
    if final == JobState.PREEMPTED:
        job.preemption_count += 1
        fields += ("preemption_count",)
    job_transition(job, final, detail, save_fields=fields)
    allocations_release(job)
    if final == JobState.PREEMPTED and job.stop_requested == "move":
        job_requeue(job, detail="requeued to be placed again (moved to free GPUs: defragmentation)")
    elif final == JobState.PREEMPTED:
        job_requeue(job, detail="requeued after preemption")
    elif final == JobState.LOST and settings.GPUSHARE["LOST_JOB_POLICY"] == "requeue":
        job_requeue(job, detail="requeued after being lost")
    schedule_soon()


def job_requeue(job: Job, *, detail: str) -> None:
    job.node = None
    job.stop_requested = ""
    job.pending_reason = "waiting for the next scheduling pass"
    job.started_at = job.finished_at = job.exit_code = None
    job_transition(
        job,
        JobState.QUEUED,
        detail,
        save_fields=("node", "stop_requested", "pending_reason", "started_at", "finished_at", "exit_code"),
    )


@acts_for_tenant("job")
@transaction.atomic
def job_cancel(*, job: Job, actor=None, reason: str = "") -> Job:
    """Cancel a queued job now; ask the agent to stop a placed one."""
    job = Job.objects.select_for_update(of=("self",)).select_related("node", "priority").get(pk=job.pk)
    who = getattr(actor, "username", "") or "the platform"
    reason = reason or f"cancelled by {who}"
    if job.state in TERMINAL_STATES:
        return job
    if job.state in (JobState.QUEUED, JobState.PREEMPTED):
        job.finished_at = timezone.now()
        job.stop_reason = reason
        job_transition(job, JobState.CANCELLED, reason, save_fields=("finished_at", "stop_reason"))
        return job
    job.stop_requested = "cancel"
    job.stop_reason = reason
    job.save(update_fields=["stop_requested", "stop_reason"])
    JobEvent.objects.create(tenant_id=job.tenant_id, job=job, from_state=job.state, to_state=job.state, detail=reason)
    payload = {"job_id": job.pk, "attempt": job.attempt, "reason": reason, "grace_s": job.priority.grace_period_s}
    transaction.on_commit(lambda: _send_to_node(job.node.name, "agent.stop", payload))
    return job


@scopes_disabled()  # a node's report: the job is found by id and checked against the node
@transaction.atomic
def job_logs_append(*, node: Node, job_id: int, offset: int, data: bytes) -> None:
    job = Job.objects.filter(pk=job_id, node=node).only("pk", "tenant_id").first()
    if job is None:
        log.warning("log chunk for job %s from node %s which does not hold it; dropped", job_id, node.name)
        return
    JobLogChunk.objects.bulk_create(
        [JobLogChunk(tenant_id=job.tenant_id, job_id=job.pk, offset=offset, data=data)], ignore_conflicts=True
    )
    job_logs_rotate(job_id=job.pk, limit=admission.log_limit(tenant_id=job.tenant_id))


def job_logs_rotate(*, job_id: int, limit: int | None) -> int:
    """Keep at most ``limit`` bytes of a job's output: drop whole chunks from the front (oldest first).

    A reader asking for an offset that was rotated off gets the output from the first chunk kept.
    Returns the number of chunks dropped.
    """
    from django.db.models import Sum
    from django.db.models.functions import Length

    from accounts.limits import log_keep_from

    from .selectors import ROTATED_MARK

    if limit is None:
        return 0
    chunks = JobLogChunk.objects.filter(job_id=job_id)
    total = chunks.aggregate(total=Sum(Length("data")))["total"] or 0
    if total <= limit:
        return 0
    rows = list(chunks.filter(offset__gte=0).order_by("offset").values_list("offset", Length("data")))
    keep_from = log_keep_from(total=total, limit=limit, chunks=rows)
    if keep_from is None:
        return 0
    dropped, _ = chunks.filter(offset__gte=0, offset__lt=keep_from).delete()
    # The mark tells readers that output before the oldest kept chunk is gone, not late (selectors).
    tenant_id = JobLogChunk.objects.filter(job_id=job_id).values_list("tenant_id", flat=True).first()
    JobLogChunk.objects.bulk_create(
        [JobLogChunk(tenant_id=tenant_id, job_id=job_id, offset=ROTATED_MARK, data=b"")], ignore_conflicts=True
    )
    return dropped


@scopes_disabled()  # a node's jobs, of every tenant
@transaction.atomic
def node_jobs_lost(*, node: Node, reason: str) -> int:
    """Mark every job placed on ``node`` lost, free its GPUs, requeue or fail per policy."""
    policy = settings.GPUSHARE["LOST_JOB_POLICY"]
    count = 0
    for job in Job.objects.select_for_update().filter(node=node, state__in=ACTIVE_STATES):
        job.finished_at = timezone.now()
        job.stop_reason = reason
        job_transition(job, JobState.LOST, reason, save_fields=("finished_at", "stop_reason"))
        allocations_release(job)
        if policy == "requeue":
            job_requeue(job, detail="requeued after node loss")
        count += 1
    if count:
        schedule_soon()
    return count


@scopes_disabled()  # a node's jobs, of every tenant
@transaction.atomic
def node_reconcile(*, node: Node, running: list[dict], as_of_ms: int | None = None) -> None:
    """After an agent (re)starts: jobs it no longer runs are lost; jobs it runs
    that the platform no longer expects there are stopped.

    ``as_of_ms``: when the agent wrote down what it runs. A job placed after that cannot be in the list
    (a registration that waited behind another while the pass placed a job there): it is left alone;
    its launch is on its way, and the launch re-send covers one that was lost."""
    reported = {(int(r["job_id"]), int(r.get("attempt", 0))) for r in running}
    expected = {
        (job.pk, job.attempt): job for job in Job.objects.select_for_update().filter(node=node, state__in=ACTIVE_STATES)
    }
    policy = settings.GPUSHARE["LOST_JOB_POLICY"]
    for key, job in expected.items():
        if key in reported:
            continue
        if as_of_ms is not None and job.scheduled_at is not None and dt_to_ms(job.scheduled_at) > as_of_ms:
            continue
        reason = f"agent on {node.name} restarted and no longer runs this job"
        job.finished_at = timezone.now()
        job.stop_reason = reason
        job_transition(job, JobState.LOST, reason, save_fields=("finished_at", "stop_reason"))
        allocations_release(job)
        if policy == "requeue":
            job_requeue(job, detail="requeued after agent restart")
    for job_id, attempt in reported - set(expected):
        payload = {"job_id": job_id, "attempt": attempt, "reason": "not expected on this node", "grace_s": 5}
        transaction.on_commit(lambda p=payload: _send_to_node(node.name, "agent.stop", p))


def tenant_running_jobs_stop(*, tenant: Tenant, reason: str) -> int:
    """Ask the agents to stop every running job of ``tenant`` (suspension, exhausted budget); the count."""
    stopped = 0
    with tenant_scope(tenant):
        jobs = list(Job.objects.filter(tenant=tenant, state__in=ACTIVE_STATES).exclude(stop_requested="cancel"))
    for job in jobs:
        job_cancel(job=job, actor=None, reason=reason)
        stopped += 1
    return stopped
