"""Read queries behind the portal's pages. Each runs inside the page's tenant scope."""

from __future__ import annotations

import calendar
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import BigIntegerField, Count, ExpressionWrapper, F, Max, Min, Q, QuerySet, Sum
from django.utils import timezone

from accounts.models import ApiToken, AuditLog, Membership, Tenant
from admission import selectors as quotas
from agents.models import Gpu
from billing.models import Invoice, UsageWindow
from billing.selectors import EstimateError, invoices_for_tenant, job_estimate
from scheduler.models import ACTIVE_STATES, MILLI_PER_GPU, Allocation, Job, JobEvent, JobMode, JobState, PriorityClass
from scheduler.selectors import jobs_for_tenant

MS_PER_DAY = 86_400_000
LIVE_STATES = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.PREEMPTED)
FAILED_STATES = (JobState.FAILED, JobState.LOST)


def ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def month_start(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_end(at: datetime) -> datetime:
    start = month_start(at)
    return start + timedelta(days=calendar.monthrange(start.year, start.month)[1])


# --- dashboard ---------------------------------------------------------------


def live_jobs(*, tenant: Tenant, limit: int = 50) -> list[Job]:
    """Queued, placed and running jobs, running first."""
    order = {JobState.RUNNING: 0, JobState.SCHEDULED: 1, JobState.PREEMPTED: 2, JobState.QUEUED: 3}
    jobs = list(jobs_for_tenant(tenant=tenant).filter(state__in=LIVE_STATES)[:limit])
    return sorted(jobs, key=lambda j: (order.get(j.state, 9), -j.pk))


@dataclass(frozen=True)
class HeldGpus:
    gpu_model: str
    mode: str
    gpu_milli: int
    jobs: int


def gpus_held(*, tenant: Tenant) -> list[HeldGpus]:
    """What the tenant holds right now, per GPU model and mode (dedicated/slices)."""
    rows = (
        Allocation.objects.filter(tenant=tenant, released_at__isnull=True)
        .values("gpu__model", "job__mode")
        .annotate(milli=Sum("share_milli"), jobs=Count("job", distinct=True))
        .order_by("gpu__model", "job__mode")
    )
    return [HeldGpus(r["gpu__model"], r["job__mode"], r["milli"], r["jobs"]) for r in rows]


@dataclass(frozen=True)
class Spend:
    month: datetime
    spent: Decimal
    projected: Decimal
    budget: Decimal | None
    alert: bool
    exhausted: bool

    @property
    def used_percent(self) -> int | None:
        return min(100, int(self.spent / self.budget * 100)) if self.budget else None

    @property
    def projected_percent(self) -> int | None:
        return min(100, int(self.projected / self.budget * 100)) if self.budget else None


def month_spend(*, tenant: Tenant, at: datetime | None = None, status: quotas.BudgetStatus | None = None) -> Spend:
    """Spend so far this calendar month (UTC), a straight-line projection to its
    end, and the budget with its alert state (from admission.selectors)."""
    at = at or timezone.now()
    start, end = month_start(at), month_end(at)
    status = status or quotas.budget_status(tenant, now=at)
    spent = status.usage.spend
    elapsed = max((at - start).total_seconds(), 3600.0)  # no wild projection in the month's first hour
    projected = (spent * Decimal((end - start).total_seconds()) / Decimal(elapsed)).quantize(Decimal("0.0001"))
    return Spend(
        month=start,
        spent=spent,
        projected=projected,
        budget=status.limits.monthly_spend_limit,
        alert=status.alert,
        exhausted=status.exhausted,
    )


@dataclass(frozen=True)
class QuotaBar:
    label: str
    used: Decimal
    limit: Decimal | None
    unit: str

    @property
    def percent(self) -> int | None:
        return min(100, int(self.used / self.limit * 100)) if self.limit else None


def _decimal(value) -> Decimal | None:
    return Decimal(value) if value not in (None, "") else None


def quota_bars(*, tenant: Tenant, held: list[HeldGpus], status: quotas.BudgetStatus | None = None) -> list[QuotaBar]:
    """Capacity in use now and GPU-hours this month, against the tenant's limits."""
    status = status or quotas.budget_status(tenant)
    limits = status.limits
    dedicated = Decimal(sum(h.gpu_milli for h in held if h.mode == JobMode.DEDICATED) // MILLI_PER_GPU)
    shared = Decimal(sum(h.gpu_milli for h in held if h.mode == JobMode.SHARED)) / MILLI_PER_GPU
    max_shared = Decimal(limits.max_shared_milli) / MILLI_PER_GPU if limits.max_shared_milli else None
    open_jobs, queued_jobs = quotas.job_counts(tenant)
    bars = [
        QuotaBar("Dedicated GPUs now", dedicated, _decimal(limits.max_dedicated_gpus), "GPUs"),
        QuotaBar("Shared slices now", shared, max_shared, "GPUs"),
        QuotaBar("GPU-hours this month", status.gpu_hours_used, _decimal(limits.gpu_hours_per_month), "h"),
        QuotaBar("Open jobs", Decimal(open_jobs), _decimal(limits.max_open_jobs), "jobs"),
        QuotaBar("Queued jobs", Decimal(queued_jobs), _decimal(limits.max_queued_jobs), "jobs"),
        QuotaBar("Endpoints", Decimal(quotas.endpoint_count(tenant)), _decimal(limits.max_endpoints), "endpoints"),
    ]
    if limits.monthly_spend_limit is not None:
        bars.append(QuotaBar("Money held + spent", status.held + status.usage.spend, limits.monthly_spend_limit, "$"))
    return bars


def limit_notes(*, status: quotas.BudgetStatus) -> list[tuple[str, str]]:
    """The per-job and per-request limits of the tenant's plan, as (name, value) lines for the quota card."""
    limits = status.limits

    def value(v, unit: str = "", scale: int = 1) -> str:
        return "no limit" if v is None else f"{v // scale:,}{unit}"

    return [
        ("Replicas per endpoint", value(limits.max_replicas_per_endpoint)),
        ("Log kept per job (older output rotated off)", value(limits.max_log_bytes_per_job, " MiB", 1 << 20)),
        ("Scratch disk per job", value(limits.max_disk_mb_per_job, " GiB", 1024)),
        ("API requests per minute (whole tenant)", value(limits.api_requests_per_minute)),
    ]


def recent_failures(*, tenant: Tenant, days: int = 7, limit: int = 5) -> list[Job]:
    since = timezone.now() - timedelta(days=days)
    return list(jobs_for_tenant(tenant=tenant).filter(state__in=FAILED_STATES, finished_at__gte=since)[:limit])


def state_counts(*, tenant: Tenant) -> dict[str, int]:
    rows = Job.objects.filter(tenant=tenant).values("state").annotate(n=Count("id"))
    return {r["state"]: r["n"] for r in rows}


# --- jobs list ------------------------------------------------------------------

SORTS = {
    "newest": ("-submitted_at", "-id"),
    "oldest": ("submitted_at", "id"),
    "cost": ("-cost", "-id"),
    "gpus": ("-gpu_milli", "-id"),
    "state": ("state", "-id"),
    "name": ("name", "-id"),
}


def jobs_search(*, tenant: Tenant, state: str = "", kind: str = "", q: str = "", sort: str = "newest") -> QuerySet:
    jobs = jobs_for_tenant(tenant=tenant)
    if state == "active":
        jobs = jobs.filter(state__in=LIVE_STATES)
    elif state in JobState.values:
        jobs = jobs.filter(state=state)
    if kind:
        jobs = jobs.filter(kind=kind)
    if q:
        match = Q(name__icontains=q) | Q(image__icontains=q) | Q(gpu_model__icontains=q)
        if q.isdigit():
            match |= Q(pk=int(q))
        jobs = jobs.filter(match)
    return jobs.order_by(*SORTS.get(sort, SORTS["newest"]))


# --- job detail -----------------------------------------------------------------


def job_events(job: Job) -> list[JobEvent]:
    return list(JobEvent.objects.filter(job=job).order_by("at", "id"))


def job_allocations(job: Job) -> list[Allocation]:
    """The GPUs of the job's latest placement (held now, or last held)."""
    allocations = list(Allocation.objects.filter(job=job).select_related("gpu__node").order_by("-created_at"))
    if not allocations:
        return []
    newest = allocations[0].created_at
    return sorted((a for a in allocations if a.created_at == newest), key=lambda a: a.gpu.index)


@dataclass
class Series:
    """Per-window points for the job's charts (x: ms since epoch)."""

    t: list[int] = field(default_factory=list)
    sm_util_pct: list[float] = field(default_factory=list)
    memory_mb: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    cost: list[str] = field(default_factory=list)


def job_series(job: Job, *, after_ms: int = 0, limit: int = 2000) -> Series:
    rows = (
        UsageWindow.objects.filter(job=job, end_ms__gt=after_ms)
        .order_by("start_ms")
        .values_list("start_ms", "end_ms", "sm_util_ms", "memory_avg_mb", "energy_mj", "amount")[:limit]
    )
    gpus = max(1, job.gpu_count)
    series = Series()
    running_cost = Decimal(0)
    if after_ms:
        running_cost = UsageWindow.objects.filter(job=job, end_ms__lte=after_ms).aggregate(c=Sum("amount"))["c"] or 0
    for start, end, sm, mem, energy, amount in rows:
        duration = end - start
        running_cost += amount
        series.t.append(end)
        series.sm_util_pct.append(round(sm / (duration * gpus) * 100, 1))
        series.memory_mb.append(mem)
        series.power_w.append(round(energy / duration, 1))
        series.cost.append(str(running_cost.quantize(Decimal("0.000001"))))
    return series


def job_live_sample(job: Job) -> dict | None:
    """The agent's latest sample of a running job, as its node's last heartbeat carried it: the job's
    own SM utilisation (mean over its GPUs) and memory; power only on whole GPUs (a shared GPU's power
    is its neighbours' too). None when there is nothing newer to show than the metering windows."""
    if job.state != JobState.RUNNING:
        return None
    held = (
        Allocation.objects.filter(job=job, released_at__isnull=True)
        .select_related("gpu__node")
        .only("share_milli", "gpu__last_metrics", "gpu__node__last_heartbeat_at")
    )
    uses, power, at = [], 0.0, None
    for allocation in held:
        metrics = allocation.gpu.last_metrics or {}
        use = (metrics.get("jobs") or {}).get(str(job.pk))
        if use is None:
            return None  # an agent that does not report per-job use yet, or a sample from before the job
        uses.append(use)
        power += float(metrics.get("power_w") or 0) if allocation.share_milli >= MILLI_PER_GPU else 0.0
        at = allocation.gpu.node.last_heartbeat_at
    if not uses or at is None:
        return None
    return {
        "t": int(at.timestamp() * 1000),
        "sm_util_pct": round(sum(float(u.get("sm_util") or 0) for u in uses) / len(uses), 1),
        "memory_mb": int(sum(int(u.get("memory_mb") or 0) for u in uses)),
        "power_w": round(power, 1) if job.mode == JobMode.DEDICATED else None,
    }


def queue_ahead(job: Job) -> int | None:
    from scheduler.selectors import queue_position

    return queue_position(job)


def is_active(job: Job) -> bool:
    return job.state in ACTIVE_STATES or job.state in (JobState.QUEUED, JobState.PREEMPTED)


# --- submit -------------------------------------------------------------------------


def gpu_models() -> list[str]:
    return list(Gpu.objects.order_by("model").values_list("model", flat=True).distinct())


def priority_classes() -> list[PriorityClass]:
    return list(PriorityClass.objects.order_by("-rank"))


@dataclass(frozen=True)
class Estimate:
    """The request's price per hour and its cost at most, over the GPU models it may land on."""

    per_hour_low: Decimal
    per_hour_high: Decimal
    max_low: Decimal
    max_high: Decimal
    max_runtime_s: int
    models: list[str]


def submit_estimate(*, gpu_milli: int, gpu_model: str, priority: PriorityClass, max_runtime_s: int) -> Estimate | None:
    """billing.selectors.job_estimate, summarised as a range (None when nothing is priced)."""
    try:
        found = job_estimate(
            gpu_milli=gpu_milli, max_runtime_s=max_runtime_s, priority=priority, gpu_model=gpu_model, at=timezone.now()
        )
    except EstimateError:
        return None
    per_hour = sorted(e.per_hour for e in found)
    max_cost = sorted(e.max_cost for e in found)
    return Estimate(
        per_hour[0], per_hour[-1], max_cost[0], max_cost[-1], max_runtime_s, sorted(e.gpu_model for e in found)
    )


# --- usage and billing ----------------------------------------------------------------


def usage_range(*, tenant: Tenant, start: datetime, end: datetime) -> QuerySet:
    return UsageWindow.objects.filter(tenant=tenant, start_ms__gte=ms(start), start_ms__lt=ms(end))


def usage_by_day(*, tenant: Tenant, start: datetime, end: datetime) -> list[dict]:
    day = ExpressionWrapper(F("start_ms") / MS_PER_DAY, output_field=BigIntegerField())
    rows = (
        usage_range(tenant=tenant, start=start, end=end)
        .annotate(day=day)
        .values("day")
        .annotate(
            gpu_ms=Sum("gpu_ms"), sm_util_ms=Sum("sm_util_ms"), amount=Sum("amount"), jobs=Count("job", distinct=True)
        )
        .order_by("day")
    )
    for row in rows:
        row["date"] = datetime.fromtimestamp(row["day"] * MS_PER_DAY / 1000, tz=UTC).date()
    return list(rows)


def usage_by_job(*, tenant: Tenant, start: datetime, end: datetime, limit: int = 100) -> list[dict]:
    return list(
        usage_range(tenant=tenant, start=start, end=end)
        .values("job_id", "job__name", "job__kind", "job__state", "gpu_model", "mode")
        .annotate(gpu_ms=Sum("gpu_ms"), amount=Sum("amount"), first_ms=Min("start_ms"), last_ms=Max("end_ms"))
        .order_by("-amount", "-job_id")[:limit]
    )


def usage_by_gpu_model(*, tenant: Tenant, start: datetime, end: datetime) -> list[dict]:
    return list(
        usage_range(tenant=tenant, start=start, end=end)
        .values("gpu_model", "mode")
        .annotate(gpu_ms=Sum("gpu_ms"), sm_util_ms=Sum("sm_util_ms"), energy_mj=Sum("energy_mj"), amount=Sum("amount"))
        .order_by("gpu_model", "mode")
    )


def invoices_for(*, tenant: Tenant, limit: int = 24) -> list[Invoice]:
    """The tenant's invoices, newest month first, with their lines (two queries)."""
    return list(invoices_for_tenant(tenant=tenant).prefetch_related("lines")[:limit])


# --- team and tokens ------------------------------------------------------------------


def members(*, tenant: Tenant) -> list[Membership]:
    return list(Membership.objects.filter(tenant=tenant).select_related("user").order_by("role", "user__username"))


def tokens(*, tenant: Tenant, user, see_all: bool) -> list[ApiToken]:
    found = ApiToken.objects.filter(tenant=tenant).select_related("user").order_by("revoked_at", "-created_at")
    return list(found if see_all else found.filter(user=user))


def audit_entries(*, tenant: Tenant, limit: int = 50) -> list[AuditLog]:
    return list(AuditLog.objects.filter(tenant=tenant).select_related("actor").order_by("-created_at", "-id")[:limit])
