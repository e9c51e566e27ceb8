"""Quotas and budgets: what a tenant may hold, submit and spend.

Limits come from the tenant's ``TenantQuota`` (the operator's overrides), then
its plan, then the plan named ``default``; a limit left empty everywhere is no
limit. Three uses:

- ``submission_check`` runs inside ``scheduler.services.job_submit`` holding
  the tenant row ``FOR SHARE`` (a suspension or quota change waits for it) and,
  for a tenant with ``max_open_jobs``, a per-tenant lock, so concurrent submits
  can never pass a limit together; without that limit they run in parallel.
  It refuses a job that can never fit (``quota_exceeded``: the message names
  the limit) and any job once the month's GPU-hours or spend is used up
  (``budget_exhausted``).
- ``tenant_limits_for_scheduling`` gives the scheduler what a tenant may hold
  at once; a job that fits the limits but not right now waits, with the
  limit named in ``pending_reason``.
- ``budgets_enforce`` (Celery beat, ``accounts.budgets_enforce``) sends the
  alert at the threshold and stops running jobs of exhausted tenants when the
  operator's setting says ``stop``.

Month usage is the sum of ``billing.UsageWindow`` (``gpu_ms``, ``amount``)
whose window starts in the current calendar month (UTC).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Sum
from django.utils import timezone
from django_scopes import scopes_disabled

from .models import Plan, RunningJobsPolicy, Tenant, TenantMonthUsage, TenantQuota

MS_PER_HOUR = 3_600_000
MILLI_PER_GPU = 1000
DEFAULT_ALERT_PERCENT = 80
DEFAULT_PLAN = "default"

QUOTA_EXCEEDED = "quota_exceeded"
BUDGET_EXHAUSTED = "budget_exhausted"


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits; None means no limit."""

    max_dedicated_gpus: int | None = None
    max_shared_milli: int | None = None
    max_gpus_per_job: int | None = None
    max_open_jobs: int | None = None
    gpu_hours_per_month: Decimal | None = None
    monthly_spend_limit: Decimal | None = None
    budget_alert_percent: int = DEFAULT_ALERT_PERCENT
    on_budget_exhausted: str = RunningJobsPolicy.STOP
    on_suspended: str = RunningJobsPolicy.STOP


@dataclass(frozen=True)
class MonthUsage:
    gpu_ms: int = 0
    spend: Decimal = Decimal(0)


@dataclass(frozen=True)
class TenantLimits:
    """What the scheduler needs: capacity a tenant may hold at once (None: no limit).

    ``blocked_reason`` is set when the tenant may not start anything now
    (suspended, budget exhausted): keep its queued jobs queued with that reason.
    """

    max_dedicated_gpus: int | None
    max_shared_milli: int | None
    blocked_reason: str = ""


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    field: str | None = None  # the request field at fault, when it is the job's size


# --- pure rules ----------------------------------------------------------------


def limits_merge(*layers) -> Limits:
    """The first non-empty value of each field, from the most specific layer down."""
    values = {}
    for f in fields(Limits):
        for layer in layers:
            value = getattr(layer, f.name, None) if layer is not None else None
            if value not in (None, ""):
                values[f.name] = value
                break
    return Limits(**values)


def budget_refusal(limits: Limits, usage: MonthUsage) -> Refusal | None:
    if limits.gpu_hours_per_month is not None and usage.gpu_ms >= limits.gpu_hours_per_month * MS_PER_HOUR:
        used = Decimal(usage.gpu_ms) / MS_PER_HOUR
        return Refusal(
            BUDGET_EXHAUSTED,
            f"this month's GPU-hours are used up ({used:.3f} of the limit gpu_hours_per_month="
            f"{limits.gpu_hours_per_month}); new jobs are refused until next month or a higher limit",
        )
    if limits.monthly_spend_limit is not None and usage.spend >= limits.monthly_spend_limit:
        return Refusal(
            BUDGET_EXHAUSTED,
            f"this month's spend limit is reached ({usage.spend:.2f} of monthly_spend_limit="
            f"{limits.monthly_spend_limit}); new jobs are refused until next month or a higher limit",
        )
    return None


def admission_refusal(limits: Limits, usage: MonthUsage, *, open_jobs: int, mode: str, gpu_milli: int):
    """Why a job may not be submitted now, or None. ``mode`` is dedicated or shared."""
    gpus = max(1, gpu_milli // MILLI_PER_GPU)
    if limits.max_gpus_per_job is not None and gpus > limits.max_gpus_per_job:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpus} GPUs; the limit max_gpus_per_job is {limits.max_gpus_per_job}",
            "gpus",
        )
    if mode == "dedicated" and limits.max_dedicated_gpus is not None and gpus > limits.max_dedicated_gpus:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpus} dedicated GPUs; the limit max_dedicated_gpus (held at once) is "
            f"{limits.max_dedicated_gpus}, so it could never start",
            "gpus",
        )
    if mode == "shared" and limits.max_shared_milli is not None and gpu_milli > limits.max_shared_milli:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpu_milli / MILLI_PER_GPU:g} of a shared GPU; the limit max_shared_capacity "
            f"(held at once) is {limits.max_shared_milli / MILLI_PER_GPU:g}, so it could never start",
            "gpus",
        )
    if limits.max_open_jobs is not None and open_jobs >= limits.max_open_jobs:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the tenant already has {open_jobs} unfinished jobs; the limit max_open_jobs is {limits.max_open_jobs}",
        )
    return budget_refusal(limits, usage)


def alert_due(limits: Limits, usage: MonthUsage) -> bool:
    """Usage has reached the alert threshold of a GPU-hour or spend limit."""
    share = Decimal(limits.budget_alert_percent) / 100
    if limits.gpu_hours_per_month is not None and usage.gpu_ms >= limits.gpu_hours_per_month * MS_PER_HOUR * share:
        return True
    return limits.monthly_spend_limit is not None and usage.spend >= limits.monthly_spend_limit * share


# --- reads ---------------------------------------------------------------------


def month_start(now: datetime | None = None) -> datetime:
    now = (now or timezone.now()).astimezone(UTC)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_bounds_ms(now: datetime | None = None) -> tuple[int, int]:
    start = month_start(now)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


@scopes_disabled()
def limits_for(tenant: Tenant) -> Limits:
    """The tenant's quota, its plan and the default plan, in one query (on every submit)."""
    names = [f.name for f in fields(Limits)]
    layers = ("q", "p", "d")
    columns = (
        ", ".join(f"{alias}.id" for alias in layers)
        + ", "
        + ", ".join(f"{alias}.{name}" for alias in layers for name in names)
    )
    quota_table, plan_table = TenantQuota._meta.db_table, Plan._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""SELECT {columns} FROM (SELECT 1 AS one) one
                LEFT JOIN {quota_table} q ON q.tenant_id = %s
                LEFT JOIN {plan_table} p ON p.id = q.plan_id
                LEFT JOIN {plan_table} d ON d.name = %s""",
            [tenant.pk, DEFAULT_PLAN],
        )
        row = cursor.fetchone()
    found = []
    for i in range(len(layers)):
        values = row[len(layers) + i * len(names) : len(layers) + (i + 1) * len(names)]
        found.append(dict(zip(names, values, strict=True)) if row[i] is not None else None)
    return limits_merge(*(_Layer(layer) if layer else None for layer in found))


class _Layer:
    """A row's limit columns as attributes (what limits_merge reads)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)


@scopes_disabled()
def month_usage(tenant: Tenant, *, now: datetime | None = None) -> MonthUsage:
    return month_usages([tenant.pk], now=now).get(tenant.pk, MonthUsage())


def _window_sums(rows) -> dict[int, MonthUsage]:
    totals = rows.values("tenant_id").annotate(gpu_ms=Sum("gpu_ms"), spend=Sum("amount"))
    return {r["tenant_id"]: MonthUsage(gpu_ms=r["gpu_ms"] or 0, spend=r["spend"] or Decimal(0)) for r in totals}


def _add(a: MonthUsage | None, b: MonthUsage | None) -> MonthUsage:
    a, b = a or MonthUsage(), b or MonthUsage()
    return MonthUsage(gpu_ms=a.gpu_ms + b.gpu_ms, spend=a.spend + b.spend)


@scopes_disabled()
def month_usages(tenant_ids=None, *, now: datetime | None = None) -> dict[int, MonthUsage]:
    """This month's usage per tenant id (all tenants when ``tenant_ids`` is None).

    Exact and cheap: the ``TenantMonthUsage`` totals up to their window id, plus a live
    sum of the windows after it (a few minutes' worth when ``month_usage_advance`` runs);
    tenants without totals yet are summed in full over the (tenant, start_ms) index.
    """
    from billing.models import UsageWindow

    start_ms, end_ms = month_bounds_ms(now)
    windows = UsageWindow.objects.filter(start_ms__gte=start_ms, start_ms__lt=end_ms)
    cached = TenantMonthUsage.objects.filter(month=month_start(now).date())
    if tenant_ids is not None:
        tenant_ids = list(tenant_ids)
        windows = windows.filter(tenant_id__in=tenant_ids)
        cached = cached.filter(tenant_id__in=tenant_ids)
    by_cursor: dict[int, list[TenantMonthUsage]] = {}
    for row in cached:
        by_cursor.setdefault(row.through_window_id, []).append(row)
    out: dict[int, MonthUsage] = {}
    for cursor, rows in by_cursor.items():
        tail = _window_sums(windows.filter(id__gt=cursor, tenant_id__in=[r.tenant_id for r in rows]))
        for row in rows:
            out[row.tenant_id] = _add(MonthUsage(gpu_ms=row.gpu_ms, spend=row.spend), tail.get(row.tenant_id))
    if tenant_ids is None:
        out.update(_window_sums(windows.exclude(tenant_id__in=list(out))))
    elif uncached := [t for t in tenant_ids if t not in out]:
        out.update(_window_sums(windows.filter(tenant_id__in=uncached)))
    return out


# A usage window's transaction commits within the Celery task time limit (300 s) of its
# insert, so every window with an id at most that of a row received this long ago is visible.
SETTLED_AFTER = timedelta(minutes=10)
# Agent clocks may run ahead: a window received before the month (less this) cannot start in it.
CLOCK_MARGIN = timedelta(hours=1)


@scopes_disabled()
def month_usage_advance(tenant_ids, *, now: datetime | None = None) -> int:
    """Fold the settled windows of this month into ``TenantMonthUsage`` (call in a transaction;
    idempotent). Returns the window id the totals now run through."""
    from billing.models import UsageWindow

    now = now or timezone.now()
    start = month_start(now)
    start_ms, end_ms = month_bounds_ms(now)
    settled = (
        UsageWindow.objects.filter(received_at__lt=now - SETTLED_AFTER).order_by("-id").values_list("id", flat=True)
    ).first() or 0
    rows = {
        row.tenant_id: row
        for row in TenantMonthUsage.objects.select_for_update().filter(tenant_id__in=tenant_ids, month=start.date())
    }
    if missing := [t for t in tenant_ids if t not in rows]:
        # Windows received before the month began (less the clock margin) cannot start in it.
        before_month = (
            UsageWindow.objects.filter(received_at__lt=start - CLOCK_MARGIN)
            .order_by("-id")
            .values_list("id", flat=True)
            .first()
        ) or 0
        for tenant_id in missing:
            rows[tenant_id], _ = TenantMonthUsage.objects.get_or_create(
                tenant_id=tenant_id, month=start.date(), defaults={"through_window_id": before_month}
            )
    by_cursor: dict[int, list[TenantMonthUsage]] = {}
    for row in rows.values():
        if row.through_window_id < settled:
            by_cursor.setdefault(row.through_window_id, []).append(row)
    for cursor, group in by_cursor.items():
        added = _window_sums(
            UsageWindow.objects.filter(
                id__gt=cursor,
                id__lte=settled,
                tenant_id__in=[r.tenant_id for r in group],
                start_ms__gte=start_ms,
                start_ms__lt=end_ms,
            )
        )
        for row in group:
            total = _add(MonthUsage(gpu_ms=row.gpu_ms, spend=row.spend), added.get(row.tenant_id))
            row.gpu_ms, row.spend, row.through_window_id = total.gpu_ms, total.spend, settled
            row.save(update_fields=["gpu_ms", "spend", "through_window_id", "updated_at"])
    return settled


@dataclass(frozen=True)
class BudgetStatus:
    """A tenant's month against its limits (for the portal and the API)."""

    limits: Limits
    usage: MonthUsage
    gpu_hours_used: Decimal
    gpu_hours_percent: Decimal | None
    spend_percent: Decimal | None
    alert: bool
    exhausted: bool


def budget_status(tenant: Tenant, *, now: datetime | None = None) -> BudgetStatus:
    limits, usage = limits_for(tenant), month_usage(tenant, now=now)
    hours = (Decimal(usage.gpu_ms) / MS_PER_HOUR).quantize(Decimal("0.001"))
    hours_pct = (
        (Decimal(usage.gpu_ms) / (limits.gpu_hours_per_month * MS_PER_HOUR) * 100).quantize(Decimal("0.1"))
        if limits.gpu_hours_per_month
        else None
    )
    spend_pct = (
        (usage.spend / limits.monthly_spend_limit * 100).quantize(Decimal("0.1"))
        if limits.monthly_spend_limit
        else None
    )
    return BudgetStatus(
        limits=limits,
        usage=usage,
        gpu_hours_used=hours,
        gpu_hours_percent=hours_pct,
        spend_percent=spend_pct,
        alert=alert_due(limits, usage),
        exhausted=budget_refusal(limits, usage) is not None,
    )


@scopes_disabled()
def budgeted_tenants() -> dict[int, Limits]:
    """Active tenants with a GPU-hour or spend limit, and their limits."""
    quotas = {q.tenant_id: q for q in TenantQuota.objects.select_related("plan")}
    default = Plan.objects.filter(name=DEFAULT_PLAN).first()
    out = {}
    for tenant_id in Tenant.objects.filter(state=Tenant.State.ACTIVE).values_list("pk", flat=True):
        quota = quotas.get(tenant_id)
        limits = limits_merge(quota, quota.plan if quota else None, default)
        if limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None:
            out[tenant_id] = limits
    return out


@scopes_disabled()
def tenant_limits_for_scheduling(*, now: datetime | None = None) -> dict[int, TenantLimits]:
    """Per tenant id: what it may hold at once. Tenants without any limit are left out."""
    quotas = {q.tenant_id: q for q in TenantQuota.objects.select_related("plan")}
    default = Plan.objects.filter(name=DEFAULT_PLAN).first()
    all_limits = {
        tenant_id: (state, limits_merge(quotas.get(tenant_id), getattr(quotas.get(tenant_id), "plan", None), default))
        for tenant_id, state in Tenant.objects.values_list("pk", "state")
    }
    budgeted = [
        tenant_id
        for tenant_id, (state, limits) in all_limits.items()
        if state == Tenant.State.ACTIVE
        and (limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None)
    ]
    usages = month_usages(budgeted, now=now) if budgeted else {}
    out: dict[int, TenantLimits] = {}
    for tenant_id, (state, limits) in all_limits.items():
        blocked = ""
        if state != Tenant.State.ACTIVE:
            blocked = f"the tenant is {state}"
        else:
            refusal = budget_refusal(limits, usages.get(tenant_id, MonthUsage()))
            blocked = refusal.message.split(";")[0] if refusal else ""
        if blocked or limits.max_dedicated_gpus is not None or limits.max_shared_milli is not None:
            out[tenant_id] = TenantLimits(
                max_dedicated_gpus=0 if blocked else limits.max_dedicated_gpus,
                max_shared_milli=0 if blocked else limits.max_shared_milli,
                blocked_reason=blocked,
            )
    return out


# --- admission (inside job_submit's transaction) ---------------------------------

OPEN_JOBS_LOCK = 0x6F70_656E  # "open": advisory lock namespace, (this, tenant id)


def _tenant_share_locked(tenant_id: int) -> Tenant:
    """The tenant row, held ``FOR SHARE`` until the caller's transaction ends.

    Shared: concurrent submits of one tenant do not wait for each other, while a
    suspension or a quota change (which lock the row ``FOR NO KEY UPDATE``) waits
    for them, so the state and limits a submit checks stay true until it commits.
    Rows that merely reference the tenant (``FOR KEY SHARE``) are never blocked.
    """
    if connection.vendor != "postgresql":  # SQLite: writers are serialised already
        return Tenant.objects.get(pk=tenant_id)
    return Tenant.objects.raw(f"SELECT * FROM {Tenant._meta.db_table} WHERE id = %s FOR SHARE", [tenant_id])[0]


def _open_jobs_lock(tenant_id: int) -> None:
    """Serialise the submits of one tenant until the caller's transaction ends.

    Only a ``max_open_jobs`` limit needs this: the count a submit sees must
    include every job committed before it, and its own job must be committed
    before the next submit counts. A transaction-level advisory lock, so the row
    lock above can stay shared (two shared holders upgrading would deadlock).
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [OPEN_JOBS_LOCK, tenant_id])


@scopes_disabled()
def submission_check(*, tenant: Tenant, mode: str, gpu_milli: int) -> None:
    """Refuse a submission the tenant's quotas or budget forbid (raises ``JobError``).

    Holds the tenant row ``FOR SHARE`` for the rest of the caller's transaction,
    and, when the tenant has a ``max_open_jobs`` limit, a per-tenant lock that
    serialises its submits so the count of open jobs they see is always the
    committed one. The other limits need no count: a job's size is checked
    against the limit alone, and submits do not change the month's usage.
    """
    from scheduler.models import TERMINAL_STATES, Job
    from scheduler.services import JobError

    locked = _tenant_share_locked(tenant.pk)
    if locked.state != Tenant.State.ACTIVE:
        raise JobError(f"tenant {locked.slug} is {locked.state} and cannot submit jobs", code="forbidden")
    limits = limits_for(locked)
    open_jobs = 0
    if limits.max_open_jobs is not None:
        _open_jobs_lock(locked.pk)
        open_jobs = Job.objects.filter(tenant_id=locked.pk).exclude(state__in=TERMINAL_STATES).count()
    budgeted = limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None
    usage = month_usage(locked) if budgeted else MonthUsage()
    refusal = admission_refusal(limits, usage, open_jobs=open_jobs, mode=mode, gpu_milli=gpu_milli)
    if refusal is not None:
        raise JobError(refusal.message, code=refusal.code, field=refusal.field)
