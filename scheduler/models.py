"""Jobs, their GPU allocations, their state history and their logs."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_scopes import ScopedManager

from accounts.models import Tenant

MILLI_PER_GPU = 1000


class PriorityClass(models.Model):
    name = models.SlugField(max_length=50, unique=True)
    rank = models.IntegerField(help_text="Higher ranks go first.")
    preemptible = models.BooleanField(default=False)
    may_preempt = models.ManyToManyField("self", symmetrical=False, blank=True, related_name="preempted_by")
    min_runtime_s = models.PositiveIntegerField(default=0)
    grace_period_s = models.PositiveIntegerField(default=30)
    price_multiplier = models.DecimalField(max_digits=6, decimal_places=3, default=1)
    default_for_kind = models.CharField(max_length=16, blank=True, help_text="training or inference")

    class Meta:
        ordering = ["-rank"]
        verbose_name_plural = "priority classes"

    def __str__(self) -> str:
        return self.name


class JobKind(models.TextChoices):
    TRAINING = "training"
    INFERENCE = "inference"


class JobMode(models.TextChoices):
    DEDICATED = "dedicated"
    SHARED = "shared"


class JobState(models.TextChoices):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    LOST = "lost"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.LOST})
ACTIVE_STATES = frozenset({JobState.SCHEDULED, JobState.RUNNING})
# Unfinished, named rather than "not terminal": `state IN (...)` uses the (tenant, state) index and
# reads only the open rows, where `NOT IN` reads every job the tenant ever ran.
OPEN_STATES = frozenset(JobState) - TERMINAL_STATES

# The job state machine, in one place. services.job_transition enforces it.
TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.QUEUED: frozenset({JobState.SCHEDULED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SCHEDULED: frozenset(
        {JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.LOST}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.LOST}
    ),
    JobState.PREEMPTED: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.LOST: frozenset({JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class JobArray(models.Model):
    """Tasks submitted in one call, like ``sbatch --array``: each task is a :class:`Job` with its
    ``array_index``, queued, placed, billed and cancellable on its own; cancelled as a group here.

    Like Slurm, the submit stores the array as this one record, admitted as a whole: ``task_spec`` holds
    what every task shares and ``tasks_made`` is false until the scheduler makes the task rows (its next
    pass, or the first read or cancel that needs them: ``scheduler.array_services.array_tasks_make``).
    Until then the array's tasks count as queued for limits, holds and the array's states."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="job_arrays")
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    name = models.CharField(max_length=200, blank=True)
    indices = models.CharField(max_length=400, help_text="The index expression, e.g. 1-1000 or 0-99:2.")
    task_count = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)
    submitted_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # The tasks' shared values (Job field attname -> value, as JSON) until the task rows are made; then {}.
    task_spec = models.JSONField(default=dict, blank=True)
    tasks_made = models.BooleanField(default=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            # Arrays whose tasks are still to be made: what a pass, an admission count and a hold look for.
            models.Index(fields=["tenant"], condition=models.Q(tasks_made=False), name="jobarray_tasks_to_make"),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(task_count__gt=0), name="jobarray_task_count_positive"),
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="jobarray_unique_idempotency_key",
            ),
        ]

    def __str__(self) -> str:
        return f"array {self.pk} [{self.indices}]"


class Job(models.Model):
    # No index of its own on tenant, array or state: the composite indexes below lead with them
    # (each index costs every insert and state change; a 1,000-task array writes 1,000 rows).
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs", db_index=False)
    # A task of an array: its array and its index there ($GPUSHARE_ARRAY_INDEX); null for a lone job.
    array = models.ForeignKey(
        JobArray, on_delete=models.CASCADE, null=True, blank=True, related_name="tasks", db_index=False
    )
    array_index = models.PositiveIntegerField(null=True, blank=True)
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    name = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=JobKind.choices)
    mode = models.CharField(max_length=16, choices=JobMode.choices)
    # GPUs asked for, in thousandths: 2 whole GPUs = 2000, a 1/8 slice = 125.
    gpu_milli = models.PositiveIntegerField()
    command = models.JSONField()
    env = models.JSONField(default=dict, blank=True)
    image = models.CharField(max_length=300, blank=True)
    gpu_model = models.CharField(max_length=64, blank=True)
    gpu_memory_mb = models.PositiveIntegerField(null=True, blank=True)
    priority = models.ForeignKey(PriorityClass, on_delete=models.PROTECT, related_name="jobs")
    max_runtime_s = models.PositiveIntegerField()

    # Idempotent submission: the same key from the same tenant returns the
    # original job; ``request_hash`` detects a different body under that key.
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)

    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    estimated_start_at = models.DateTimeField(null=True, blank=True)
    pending_reason = models.CharField(max_length=200, blank=True)
    node = models.ForeignKey("agents.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="jobs")
    isolation = models.CharField(max_length=16, blank=True)  # exclusive | mig | mps | none
    preemption_count = models.PositiveIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=0)

    submitted_at = models.DateTimeField(auto_now_add=True, db_index=True)
    scheduled_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # Set when the platform asks the agent to stop the job: cancel, preempt,
    # budget, lost...; the job's final state follows from it when the agent
    # reports the exit.
    stop_requested = models.CharField(max_length=16, blank=True)
    stop_reason = models.CharField(max_length=200, blank=True)

    # Running totals kept by billing.services.usage_windows_ingest in the same
    # transaction as the windows themselves.
    cost = models.DecimalField(max_digits=20, decimal_places=10, default=0)
    gpu_ms = models.BigIntegerField(default=0)
    sm_util_ms = models.BigIntegerField(default=0)
    memory_peak_mb = models.PositiveIntegerField(default=0)
    energy_mj = models.BigIntegerField(default=0)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "state"]),
            models.Index(fields=["state", "submitted_at"]),
            # The queue in its order within a class: queue positions count a range of it.
            models.Index(
                fields=["priority", "submitted_at", "id"], condition=models.Q(state="queued"), name="job_queued_order"
            ),
            # Keyset pagination of a tenant's jobs, newest first (the list's order).
            models.Index(fields=["tenant", "-submitted_at", "-id"], name="job_tenant_newest"),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(gpu_milli__gt=0), name="job_gpu_milli_positive"),
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="job_unique_idempotency_key",
            ),
            models.UniqueConstraint(
                fields=["array", "array_index"], condition=models.Q(array__isnull=False), name="job_unique_array_index"
            ),
            models.CheckConstraint(
                condition=models.Q(array__isnull=True, array_index__isnull=True)
                | models.Q(array__isnull=False, array_index__isnull=False),
                name="job_array_index_with_array",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.state})"

    @property
    def gpus(self):
        from decimal import Decimal

        whole, rest = divmod(self.gpu_milli, MILLI_PER_GPU)
        return whole if rest == 0 else Decimal(self.gpu_milli) / MILLI_PER_GPU

    @property
    def gpu_count(self) -> int:
        """How many GPUs the job spans (a slice is on one GPU)."""
        return max(1, self.gpu_milli // MILLI_PER_GPU)


class OpenJob(models.Model):
    """The unfinished jobs, narrow: one row per job that is queued, placed, running or preempted, with
    its tenant, class, submission time and state, written by the database itself (PostgreSQL triggers
    on ``scheduler_job``, migration 0006), never by the application.

    What reads it: the queue positions of a page of jobs (the queued jobs ahead of them), and the
    triggers that keep :class:`OpenJobCount` (a submit's own position and its tenant's counts). Counted
    on ``scheduler_job``, every job ever submitted leaves entries in that wide, large table's indexes
    until it is vacuumed, so a count visited thousands of wide rows (~30 ms for a submit's position with
    3,400 queued, ~8 ms for its tenant's 6,900 open jobs); here a row is gone when its job finishes and a
    page holds hundreds. SQLite (the demo): the table stays empty and the counts are made on the jobs.
    """

    job = models.OneToOneField(
        "Job", primary_key=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    tenant = models.ForeignKey(
        Tenant, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    priority = models.ForeignKey(
        PriorityClass, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    submitted_at = models.DateTimeField()
    state = models.CharField(max_length=16, choices=JobState.choices)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "state"], name="open_job_tenant"),
            models.Index(
                fields=["priority", "submitted_at", "job"], condition=models.Q(state="queued"), name="open_job_queue"
            ),
        ]


class OpenJobCount(models.Model):
    """How many unfinished (``open``) and queued jobs each tenant has in each class, so that a submit's
    counts and queue position do not grow with the queue. Written by the database (migration 0008):
    every change of ``OpenJob`` appends a :class:`OpenJobCountChange` (inserts only: no row that two
    submits, or a submit and a pass, would both lock), and :func:`scheduler.counts.counts_fold` (each
    scheduling pass) adds the changes here and deletes them. A count is this row plus the changes not
    folded yet, read in one statement (one snapshot: before a fold commits or after it, never half).
    SQLite (the demo): empty; counts are made on the jobs."""

    tenant = models.ForeignKey(  # the unique (tenant, priority) index serves a tenant's rows
        Tenant, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    priority = models.ForeignKey(
        PriorityClass, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    open = models.IntegerField(default=0)
    queued = models.IntegerField(default=0)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "priority"], name="open_job_count_once")]


class OpenJobCountChange(models.Model):
    """One change of :class:`OpenJobCount` not folded into it yet (see there)."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    priority = models.ForeignKey(
        PriorityClass, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    open = models.IntegerField()
    queued = models.IntegerField()

    objects = ScopedManager(tenant="tenant")


class Allocation(models.Model):
    """A GPU (or a slice of one) held by a job. Released, never deleted."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey("agents.Gpu", on_delete=models.PROTECT, related_name="allocations")
    share_milli = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)

    objects = models.Manager()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(share_milli__gt=0, share_milli__lte=1000), name="allocation_share_range"
            ),
            models.UniqueConstraint(
                fields=["gpu"],
                condition=models.Q(share_milli=1000, released_at__isnull=True),
                name="allocation_one_dedicated_holder",
            ),
        ]


class JobEvent(models.Model):
    """The job's timeline: every state change, with why."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    detail = models.CharField(max_length=300, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["at", "id"]


class JobMove(models.Model):
    """A slice moved (drained with its grace period and queued again) so that a waiting job can start on the
    cards it frees: defragmentation (``scheduler.placement.defrag``). The rows of one decision share
    ``for_job`` and ``freed``; while ``for_job`` waits, ``freed`` is promised to it. Also the disturbance
    history: a job or an endpoint is moved at most once per ``SchedulerSettings.defrag_min_interval_s``."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")  # the moved job's
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="moves")
    for_job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="moves_for")
    endpoint_id = models.PositiveIntegerField(null=True, blank=True)  # a replica: its endpoint (no FK: a higher app)
    node = models.CharField(max_length=100)
    gpu_uuid = models.CharField(max_length=100)  # where the moved slice ran
    freed = models.JSONField(default=list)  # uuids of the GPUs freed for for_job
    reason = models.CharField(max_length=300)
    at = models.DateTimeField()
    free_at = models.DateTimeField()  # when the moved slices are expected gone (the grace period)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["at", "id"]
        indexes = [
            models.Index(fields=["job", "at"], name="jobmove_job_at"),
            models.Index(fields=["endpoint_id", "at"], name="jobmove_endpoint_at"),
            models.Index(fields=["for_job", "at"], name="jobmove_for_job_at"),
        ]


class JobLogChunk(models.Model):
    """A piece of a job's output, at a byte offset; shipped by the agent."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_chunks")
    offset = models.BigIntegerField()
    data = models.BinaryField()

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["offset"]
        constraints = [models.UniqueConstraint(fields=["job", "offset"], name="joblog_unique_offset")]


class TenantShare(models.Model):
    """A tenant's fair-share weight: with weights 1 and 3, two busy tenants get 25% and 75%."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="scheduler_share")
    weight = models.DecimalField(max_digits=8, decimal_places=3, default=1)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(weight__gt=0), name="tenantshare_weight_positive")]

    def __str__(self) -> str:
        return f"{self.tenant_id}: weight {self.weight}"


class TenantUsage(models.Model):
    """A tenant's decayed GPU usage (thousandths x ms), brought up to date by each pass."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="scheduler_usage")
    usage = models.FloatField(default=0)
    as_of_ms = models.BigIntegerField()

    objects = ScopedManager(tenant="tenant")


class SchedulerSettings(models.Model):
    """The scheduler's knobs (one row, ``pk=1``); read at the start of every pass."""

    fair_share_half_life_s = models.PositiveIntegerField(
        default=7 * 24 * 3600, help_text="How fast past usage stops counting against a tenant."
    )
    default_max_runtime_s = models.PositiveIntegerField(
        default=24 * 3600, help_text="Runtime assumed for jobs that give none (backfill and estimates use it)."
    )
    backfill = models.BooleanField(default=True, help_text="Let smaller jobs start if they do not delay the head.")
    defrag = models.BooleanField(
        default=True,
        help_text="Move slices (preemptible, or replicas of endpoints with more than one) off the cards a waiting "
        "gang or higher-priority job needs, when that lets it start.",
    )
    defrag_min_interval_s = models.PositiveIntegerField(
        default=30 * 60, help_text="A job, or an endpoint's replicas, is moved at most once per this many seconds."
    )
    defrag_min_gain_s = models.PositiveIntegerField(
        default=10 * 60, help_text="Move only if the waiting job would otherwise start at least this much later."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "scheduler settings"
        constraints = [models.CheckConstraint(condition=models.Q(pk=1), name="schedulersettings_singleton")]
        # fair_share_half_life_s > 0 is checked by scheduler.rules.scheduler_settings_update.

    def __str__(self) -> str:
        return "scheduler settings"


class ShownNamesVersion(models.Model):
    """One row (``pk=1``), written by PostgreSQL triggers whenever a name a job page shows changes: a class's
    or a node's name, a GPU's uuid or index, or such a row deleted. Its row version is part of every kept
    job page's versions (``api.page_selectors``): a rename is seen at once, while the writes that leave the
    names alone (a node's heartbeat, a GPU's health) leave kept pages alone too."""

    changes = models.BigIntegerField(default=0, help_text="How many times a shown name has changed.")

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(pk=1), name="shownnamesversion_singleton")]

    def __str__(self) -> str:
        return f"shown names, changed {self.changes} times"
