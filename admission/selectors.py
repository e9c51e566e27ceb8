"""Reads for admission: a tenant's month, its open money holds, its budget, the scheduler's caps.

Month usage is the sum of ``billing.UsageWindow`` (``gpu_ms``, ``amount``) whose window starts
in the current calendar month (UTC), read through the ``accounts.TenantMonthUsage`` running
totals (``services.month_usage_advance``) plus a live sum of the windows after them.

Every function takes the tenant and reads in its scope (``accounts.tenancy``), or reads all tenants
(said in its name, with scopes disabled and a comment saying why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from django.conf import settings
from django.db import connection
from django.db.models import DecimalField, IntegerField, OuterRef, Subquery, Sum, Value
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.limits import (
    MS_PER_HOUR,
    Budget,
    Limits,
    MonthUsage,
    alert_due,
    budget_refusal,
    hold_open,
    max_cost,
)
from accounts.models import Tenant, TenantMonthUsage
from accounts.selectors import LIMITS_COLUMNS, limits_all, limits_for, limits_from_row, limits_params, limits_sql
from accounts.tenancy import acts_for_tenant
from billing.models import Price, UsageWindow
from endpoints.models import Endpoint
from gpushare.prepared import ServerStatement, model_columns_sql, positional_named
from scheduler.admission import TenantCaps, Write
from scheduler.counts import tenant_counts_sql
from scheduler.models import OPEN_STATES, Job, JobArray, JobState, PriorityClass

# --- the month ----------------------------------------------------------------------------------------


def month_start(now: datetime | None = None) -> datetime:
    now = (now or timezone.now()).astimezone(UTC)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_bounds_ms(now: datetime | None = None) -> tuple[int, int]:
    start = month_start(now)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def window_sums(rows) -> dict[int, MonthUsage]:
    totals = rows.values("tenant_id").annotate(gpu_ms=Sum("gpu_ms"), spend=Sum("amount"))
    return {r["tenant_id"]: MonthUsage(gpu_ms=r["gpu_ms"] or 0, spend=r["spend"] or Decimal(0)) for r in totals}


def usage_add(a: MonthUsage | None, b: MonthUsage | None) -> MonthUsage:
    a, b = a or MonthUsage(), b or MonthUsage()
    return MonthUsage(gpu_ms=a.gpu_ms + b.gpu_ms, spend=a.spend + b.spend)


@scopes_disabled()  # platform-wide: the beat and the scheduler's caps read every budgeted tenant
def month_usages(tenant_ids=None, *, now: datetime | None = None) -> dict[int, MonthUsage]:
    return _month_usages(tenant_ids, now=now)


def _month_usages(tenant_ids=None, *, now: datetime | None = None) -> dict[int, MonthUsage]:
    """This month's usage per tenant id (all tenants when ``tenant_ids`` is None).

    Exact and cheap: the ``TenantMonthUsage`` totals up to their window id, plus a live
    sum of the windows after it (a few minutes' worth when ``month_usage_advance`` runs);
    tenants without totals yet are summed in full over the (tenant, start_ms) index.
    """
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
        tail = window_sums(windows.filter(id__gt=cursor, tenant_id__in=[r.tenant_id for r in rows]))
        for row in rows:
            out[row.tenant_id] = usage_add(MonthUsage(gpu_ms=row.gpu_ms, spend=row.spend), tail.get(row.tenant_id))
    if tenant_ids is None:
        out.update(window_sums(windows.exclude(tenant_id__in=list(out))))
    elif uncached := [t for t in tenant_ids if t not in out]:
        out.update(window_sums(windows.filter(tenant_id__in=uncached)))
    return out


@acts_for_tenant
def month_usage(tenant: Tenant, *, now: datetime | None = None) -> MonthUsage:
    return _month_usages([tenant.pk], now=now).get(tenant.pk, MonthUsage())


# --- money holds --------------------------------------------------------------------------------------


def prices_now(*, at: datetime | None = None) -> dict[tuple[str, str], Decimal]:
    """The price per GPU-hour in force now, by (gpu_model, mode)."""
    current: dict[tuple[str, str], Decimal] = {}
    rows = Price.objects.filter(effective_from__lte=at or timezone.now()).order_by(
        "gpu_model", "mode", "-effective_from"
    )
    for gpu_model, mode, price in rows.values_list("gpu_model", "mode", "per_gpu_hour"):
        current.setdefault((gpu_model, mode), price)
    return current


def price_ceiling(prices: dict[tuple[str, str], Decimal], *, mode: str, gpu_model: str = "") -> Decimal:
    """The job's price; without a GPU model, the dearest model of the mode (it may land on any)."""
    if gpu_model:
        return prices.get((gpu_model, mode), Decimal(0))
    return max((p for (_, m), p in prices.items() if m == mode), default=Decimal(0))


def job_hold(prices, *, mode: str, gpu_model: str, gpu_milli: int, max_runtime_s: int, multiplier: Decimal) -> Decimal:
    """What admission reserves for one job: its GPUs × max runtime × its price (× the class multiplier)."""
    per_gpu_hour = price_ceiling(prices, mode=mode, gpu_model=gpu_model)
    return max_cost(gpu_milli=gpu_milli, seconds=max_runtime_s, per_gpu_hour=per_gpu_hour, multiplier=multiplier)


def hold_horizon_s() -> int:
    return int(settings.GPUSHARE.get("ENDPOINT_HOLD_HORIZON_S", 24 * 3600))


def endpoint_hold(prices, *, gpu_milli: int, gpu_model: str, max_replicas: int, multiplier: Decimal) -> Decimal:
    """An endpoint reserves its max replicas for the billing horizon (``ENDPOINT_HOLD_HORIZON_S``)."""
    return job_hold(
        prices,
        mode="shared" if gpu_milli % 1000 else "dedicated",
        gpu_model=gpu_model,
        gpu_milli=gpu_milli * max_replicas,
        max_runtime_s=hold_horizon_s(),
        multiplier=multiplier,
    )


@acts_for_tenant
def holds_open(tenant: Tenant, *, exclude_endpoint_id: int | None = None, prices=None) -> Decimal:
    """What the tenant's unfinished jobs and live endpoints reserve now.

    A job's hold is its max cost less what has been metered for it (it shrinks as usage
    arrives) and is gone once the job ends (it is read from the job's state, so it can
    never leak). A replica is covered by its endpoint's hold.
    """
    prices = prices_now() if prices is None else prices
    metered = (
        UsageWindow.objects.filter(job_id=OuterRef("pk"))
        .values("job_id")
        .annotate(total=Sum("amount"))
        .values("total")[:1]
    )
    jobs = (
        Job.objects.filter(tenant_id=tenant.pk, replica__isnull=True)
        .filter(state__in=OPEN_STATES)
        .annotate(metered=Coalesce(Subquery(metered), Value(Decimal(0)), output_field=DecimalField()))
        .values_list("mode", "gpu_model", "gpu_milli", "max_runtime_s", "priority__price_multiplier", "metered")
    )
    held = Decimal(0)
    for mode, gpu_model, gpu_milli, runtime, multiplier, used in jobs:
        amount = job_hold(
            prices, mode=mode, gpu_model=gpu_model, gpu_milli=gpu_milli, max_runtime_s=runtime, multiplier=multiplier
        )
        held += hold_open(amount=amount, metered=used)
    held += _array_holds(tenant, prices)
    endpoints = Endpoint.objects.filter(tenant_id=tenant.pk, state=Endpoint.State.ACTIVE)
    if exclude_endpoint_id is not None:
        endpoints = endpoints.exclude(pk=exclude_endpoint_id)
    for gpu_milli, gpu_model, replicas, multiplier in endpoints.values_list(
        "gpu_milli", "gpu_model", "max_replicas", "priority"
    ):
        held += endpoint_hold(
            prices, gpu_milli=gpu_milli, gpu_model=gpu_model, max_replicas=replicas, multiplier=_multiplier(multiplier)
        )
    return held


def _array_holds(tenant: Tenant, prices) -> Decimal:
    """What the tasks of the tenant's arrays not made into jobs yet reserve: each task's full hold."""
    multiplier = PriorityClass.objects.filter(
        pk=Cast(KeyTextTransform("priority_id", OuterRef("task_spec")), output_field=IntegerField())
    ).values("price_multiplier")[:1]
    waiting = (
        JobArray.objects.filter(tenant_id=tenant.pk, tasks_made=False)
        .annotate(multiplier=Subquery(multiplier))
        .values_list("task_spec", "task_count", "multiplier")
    )
    return sum(
        (
            count
            * job_hold(
                prices,
                mode=spec["mode"],
                gpu_model=spec["gpu_model"],
                gpu_milli=spec["gpu_milli"],
                max_runtime_s=spec["max_runtime_s"],
                multiplier=multiplier,
            )
            for spec, count, multiplier in waiting
        ),
        Decimal(0),
    )


def _multiplier(priority_name: str) -> Decimal:
    """The price multiplier of an endpoint's class (blank: the inference default's)."""
    from scheduler.services import JobError, priority_for

    for name in (priority_name or "serving", ""):  # what a replica is submitted with, then the default
        try:
            return priority_for(kind="inference", name=name).price_multiplier
        except JobError:
            continue
    return Decimal(1)


def budget_now(tenant: Tenant, limits: Limits, *, usage: MonthUsage | None = None, **kw) -> Budget | None:
    """The tenant's money budget now (limit, spent, held), or None without a spend limit."""
    if limits.monthly_spend_limit is None:
        return None
    usage = usage if usage is not None else month_usage(tenant)
    return Budget(limit=limits.monthly_spend_limit, spent=usage.spend, held=holds_open(tenant, **kw))


# --- counts -------------------------------------------------------------------------------------------


def _job_counts_sql(jobs: str) -> str:
    """Open and queued jobs of a tenant (``jobs``: a subquery of its ``open`` and ``queued``), with the
    tasks of its arrays the scheduler has not made yet (queued, one row per array: ``JobArray.tasks_made``)."""
    return f"""SELECT jobs.open + arrays.tasks AS open, jobs.queued + arrays.tasks AS queued FROM {jobs} AS jobs,
                 (SELECT coalesce(sum(task_count), 0) AS tasks FROM {JobArray._meta.db_table}
                    WHERE tenant_id = %(tenant)s AND NOT tasks_made) AS arrays"""


_OPEN = ", ".join(f"'{state}'" for state in sorted(OPEN_STATES))  # the enum's own values, not input
# PostgreSQL: the per-class counts the database keeps (scheduler.counts), whose cost does not grow with the
# tenant's open jobs; SQLite (the demo, no triggers): a count of the jobs themselves.
_JOB_COUNTS_SQL = {
    "postgresql": _job_counts_sql(tenant_counts_sql("%(tenant)s")),
    "other": _job_counts_sql(
        f"""(SELECT count(*) AS open, count(*) FILTER (WHERE state = '{JobState.QUEUED}') AS queued
               FROM {Job._meta.db_table} WHERE tenant_id = %(tenant)s AND state IN ({_OPEN}))"""
    ),
}


def _vendor() -> str:
    return "postgresql" if connection.vendor == "postgresql" else "other"


@acts_for_tenant
def job_counts(tenant: Tenant) -> tuple[int, int]:
    """(unfinished jobs, queued jobs) of the tenant, replicas included; one statement (see above)."""
    with connection.cursor() as cursor:
        cursor.execute(_JOB_COUNTS_SQL[_vendor()], {"tenant": tenant.pk})
        open_jobs, queued = cursor.fetchone()
    return open_jobs, queued


WRITE_PREFIX = "w"  # a write's values sent with the limits and counts: %(w0)s, %(w1)s, ...


@functools.cache
def _limits_and_counts(vendor: str, *, tenant_row: bool = False, write: tuple = ()) -> ServerStatement:
    """The limits and job counts of ``%(tenant)s``; ``tenant_row``: the tenant's row before them; ``write``:
    a submit's insert sent with them, as ``(ctes, select, columns)`` of a ``scheduler.admission.Write``,
    its values named ``%(w0)s``, ``%(w1)s``, ... (:func:`write_params`), its columns after the counts."""
    columns, tables = limits_sql()
    counts = f"CROSS JOIN ({_JOB_COUNTS_SQL[vendor]}) AS counts"
    if not tenant_row:
        return ServerStatement(f"SELECT {columns}, counts.open, counts.queued FROM {tables} {counts}")
    head = joined = written = ""
    if write:
        ctes, select, written_columns = write
        head = f"WITH {positional_named(f'{ctes}, w AS ({select})', WRITE_PREFIX)} "
        joined = " LEFT JOIN w ON true"  # the read's row whether or not the write's condition held
        written = "".join(f", w.{name}" for name in written_columns)
    return ServerStatement(
        f"{head}SELECT {model_columns_sql(Tenant, 't')}, {columns}, counts.open, counts.queued{written} "
        f"FROM {Tenant._meta.db_table} t CROSS JOIN {tables} {counts}{joined} WHERE t.id = %(tenant)s"
    )


@acts_for_tenant
def limits_and_job_counts(tenant: Tenant) -> tuple[Limits, int, int]:
    """The tenant's limits (``limits_for``) and ``job_counts``, in one statement: what a submit checks
    once it holds the admission lock (its snapshot is taken after the lock is granted). Planned once per
    connection: planning it cost twice what running it does."""
    with connection.cursor() as cursor:
        _limits_and_counts(_vendor()).execute(cursor, limits_params(tenant))
        row = cursor.fetchone()
    return limits_from_row(row), row[LIMITS_COLUMNS], row[LIMITS_COLUMNS + 1]


def tenant_limits_and_counts_statement(write: Write | None = None) -> ServerStatement:
    """PostgreSQL: the tenant's row (``model_columns(Tenant)``), then its limits (``limits_sql``) and job
    counts, in one statement: what a submit reads right after it took the admission locks
    (``admission.services``: sent with them in one round trip). With ``write``, the write's columns follow
    (its values: :func:`write_params`); the read, one snapshot with it, does not see what it writes."""
    shape = (write.ctes, write.select, write.columns) if write is not None else ()
    return _limits_and_counts("postgresql", tenant_row=True, write=shape)


def write_params(write: Write) -> dict:
    """The values of ``write`` as :func:`tenant_limits_and_counts_statement` names them."""
    return {f"{WRITE_PREFIX}{i}": value for i, value in enumerate(write.params)}


@acts_for_tenant
def endpoint_count(tenant: Tenant, *, exclude_id: int | None = None) -> int:
    rows = Endpoint.objects.filter(tenant_id=tenant.pk, state=Endpoint.State.ACTIVE)
    return (rows.exclude(pk=exclude_id) if exclude_id is not None else rows).count()


# --- status for the portal and the API ----------------------------------------------------------------


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
    held: Decimal = Decimal(0)  # money reserved by unfinished jobs and live endpoints
    budget_left: Decimal | None = None  # spend limit - spent - held (None: no spend limit)


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
    held = holds_open(tenant)
    budget = (
        Budget(limit=limits.monthly_spend_limit, spent=usage.spend, held=held)
        if limits.monthly_spend_limit is not None
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
        held=held.quantize(Decimal("0.01")),
        budget_left=budget.left.quantize(Decimal("0.01")) if budget else None,
    )


# --- platform-wide reads (the beat, the scheduler) ----------------------------------------------------


def budgeted_tenants() -> dict[int, Limits]:
    """Active tenants with a GPU-hour or spend limit, and their limits."""
    return {
        tenant_id: limits
        for tenant_id, (state, limits) in limits_all().items()
        if state == Tenant.State.ACTIVE
        and (limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None)
    }


def tenant_caps_for_scheduling(*, now: datetime | None = None) -> dict[int, TenantCaps]:
    """Per tenant id: what it may hold at once. Tenants without any limit are left out."""
    all_limits = limits_all()
    budgeted = [
        tenant_id
        for tenant_id, (state, limits) in all_limits.items()
        if state == Tenant.State.ACTIVE
        and (limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None)
    ]
    usages = month_usages(budgeted, now=now) if budgeted else {}
    out: dict[int, TenantCaps] = {}
    for tenant_id, (state, limits) in all_limits.items():
        if state != Tenant.State.ACTIVE:
            blocked = f"the tenant is {state}"
        else:
            refusal = budget_refusal(limits, usages.get(tenant_id, MonthUsage()))
            blocked = refusal.message.split(";")[0] if refusal else ""
        if blocked or limits.max_dedicated_gpus is not None or limits.max_shared_milli is not None:
            out[tenant_id] = TenantCaps(
                max_dedicated_gpus=0 if blocked else limits.max_dedicated_gpus,
                max_shared_milli=0 if blocked else limits.max_shared_milli,
                blocked_reason=blocked,
            )
    return out


@dataclass(frozen=True)
class HoldPreview:
    """What submitting a job would hold, and whether it fits (the portal's submit form)."""

    amount: Decimal
    limit: Decimal | None
    held: Decimal
    left: Decimal | None
    fits: bool


def hold_preview(
    *, tenant: Tenant, mode: str, gpu_milli: int, gpu_model: str, max_runtime_s: int, multiplier: Decimal
) -> HoldPreview:
    prices = prices_now()
    amount = job_hold(
        prices, mode=mode, gpu_model=gpu_model, gpu_milli=gpu_milli, max_runtime_s=max_runtime_s, multiplier=multiplier
    )
    limits = limits_for(tenant)
    budget = budget_now(tenant, limits, prices=prices)
    if budget is None:
        return HoldPreview(amount=amount, limit=None, held=Decimal(0), left=None, fits=True)
    return HoldPreview(
        amount=amount,
        limit=budget.limit,
        held=budget.held.quantize(Decimal("0.01")),
        left=budget.left.quantize(Decimal("0.01")),
        fits=budget.spent + budget.held + amount <= budget.limit,
    )
