"""Admission writes and checks: may this tenant start this now? Each runs in the caller's transaction.

``job_admit`` (through the scheduler's port, inside ``job_submit``'s transaction) holds a
per-tenant advisory lock and the tenant row ``FOR SHARE`` (a suspension or a quota change waits
for it) until commit, and reads the limits and counts under them. The lock is exclusive when
exactness needs it (a money hold, an array, or counts near a limit): those submits are checked
one after another, each seeing every job committed before it. A single job far from its limits
takes the lock shared, so one tenant's submits run side by side: at most ``in_flight_bound()``
transactions can be open at once (the database's connection limit), so if the committed count
leaves that much room, no interleaving can pass the limit. Other tenants are never delayed.

Services that act across tenants (the budget beat) say so; the rest run in the scope of the tenant they take.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.limits import (
    MS_PER_HOUR,
    Limits,
    MonthUsage,
    Refusal,
    alert_due,
    budget_refusal,
    count_refusal,
    endpoint_refusal,
    hold_refusal,
    size_refusal,
)
from accounts.models import AuditLog, Plan, RunningJobsPolicy, Tenant, TenantMonthUsage, TenantQuota
from accounts.selectors import LIMITS_COLUMNS, limits_for, limits_from_row, limits_params
from accounts.services import audit_record
from accounts.services.tenants import running_jobs_stop
from accounts.tenancy import acts_for_tenant
from billing.models import UsageWindow
from endpoints.services import EndpointError
from gpushare.prepared import ServerStatement, execute_in_turn, model_columns, model_columns_sql, model_from_row
from scheduler.admission import JobAsk, Write
from scheduler.services import AdmitAgain, JobError
from webhooks import emit as webhook_emit

from . import selectors
from .selectors import tenant_caps_for_scheduling  # noqa: F401  (provided to the scheduler's port)

ADMISSION_LOCK = 0x6F70_656E  # "open": advisory lock namespace, (this, tenant id)


@functools.cache
def _tenant_locked_statement(exact: bool, *, row: bool = True) -> ServerStatement:
    """The admission locks (``_tenant_locked``); ``row``: answering the tenant's row, else nothing (the locks
    alone, for a read sent after them)."""
    function = "pg_advisory_xact_lock" if exact else "pg_advisory_xact_lock_shared"
    columns = f"{model_columns_sql(Tenant, 't')}, " if row else ""
    return ServerStatement(
        f"SELECT {columns}{function}(%(space)s::integer, %(tenant)s::integer) FROM {Tenant._meta.db_table} t "
        "WHERE t.id = %(tenant)s FOR SHARE OF t"
    )


def _tenant_locked(tenant_id: int, *, exact: bool) -> Tenant:
    """Take the tenant's admission lock, then its row ``FOR SHARE``, both held until the caller's
    transaction ends, in one statement (the lock is in the select list: the scan computes it before
    the row is locked). Every transaction that takes both takes them in this order.

    The advisory lock is exclusive when ``exact``: it waits for every other admission of the tenant;
    shared, it waits only for exclusive ones. The row lock is shared: concurrent submits of one tenant
    do not block each other on it, while a suspension or a quota change (which lock it ``FOR NO KEY
    UPDATE``) waits for them, so what a submit checks stays true until it commits. The row answered is
    its newest version (a row lock always locks that one), so a suspension committed while this waited
    is seen.
    """
    if connection.vendor != "postgresql":  # SQLite: writers are serialised already
        return Tenant.objects.get(pk=tenant_id)
    with connection.cursor() as cursor:
        _tenant_locked_statement(exact).execute(cursor, {"space": ADMISSION_LOCK, "tenant": tenant_id})
        row = cursor.fetchone()
    if row is None:
        raise Tenant.DoesNotExist(f"no tenant {tenant_id}")
    return model_from_row(Tenant, row)


def _tenant_locked_with_limits(
    tenant: Tenant, *, exact: bool, write: Write | None = None
) -> tuple[Tenant, Limits, int, int, tuple | None]:
    """``_tenant_locked``, then the tenant's limits and open and queued job counts read under the locks:
    (the tenant's newest row, limits, open, queued, what ``write`` answered). On PostgreSQL the two
    statements go in one round trip (``execute_in_turn``): the read is a statement of its own, whose snapshot
    is taken once the locks are granted, so it sees every admission that committed while this one waited,
    and the tenant's row as its lock left it (a suspension that committed meanwhile is seen). ``write`` (the
    submit's insert, PostgreSQL only) goes in the read's statement: under the locks, unseen by the read."""
    if connection.vendor != "postgresql":
        locked = _tenant_locked(tenant.pk, exact=exact)
        return locked, *selectors.limits_and_job_counts(locked), None
    params = {"space": ADMISSION_LOCK, **limits_params(tenant)}
    if write is not None:
        params.update(selectors.write_params(write))
    with connection.cursor() as cursor:
        execute_in_turn(
            cursor,
            [
                (_tenant_locked_statement(exact, row=False), params),
                (selectors.tenant_limits_and_counts_statement(write), params),
            ],
        )
        row = cursor.fetchone()
    if row is None:
        raise Tenant.DoesNotExist(f"no tenant {tenant.pk}")
    width = len(model_columns(Tenant))
    counted = width + LIMITS_COLUMNS  # where the counts are, the write's columns after them
    written = tuple(row[counted + 2 :]) if write is not None else None
    return model_from_row(Tenant, row), limits_from_row(row[width:]), row[counted], row[counted + 1], written


_in_flight_bound: int | None = None


def in_flight_bound() -> int:
    """How many admissions can be uncommitted at once: PostgreSQL's ``max_connections`` (read once)."""
    global _in_flight_bound
    if _in_flight_bound is None:
        with connection.cursor() as cursor:
            cursor.execute("SHOW max_connections")
            _in_flight_bound = int(cursor.fetchone()[0])
    return _in_flight_bound


# tenant id -> its limits (and when they were read), and (open, queued) plus what was admitted then, as this
# process last read them under the lock: the unlocked look of the tenant's next submit here, in place of
# reads of its own. Only a hint (other processes' jobs, and limits they changed, are not in it): what is read
# under the lock decides, and a submit the hint misleads into the shared path (near a limit, or a money
# limit set since) is admitted again, exactly (``AdmitAgain``), with the hint renewed; inside a caller's
# transaction, which cannot be run again, it answers 409. Limits changed by this process drop its hints at
# once (``limits_changed``); limits older than ``LIMITS_HINT_S`` are looked at again. A hint only saves
# statements (a wrong one costs one admission again), so it lasts minutes: at 5 s, a CI pipeline submitting
# every few seconds, or the bench's array call after its one-job rounds, missed it and paid the unlocked look
# or the separate insert every time (docs/benchmarks.md, session 29).
LIMITS_HINT_S = 300.0
_limits_last: dict[int, tuple[Limits, float]] = {}
_counts_last: dict[int, tuple[int, int]] = {}


@receiver([post_save, post_delete], sender=TenantQuota)
@receiver([post_save, post_delete], sender=Plan)
def limits_changed(sender, instance, **kwargs) -> None:
    """A quota or plan written by this process: the next submit of the tenants it covers looks again."""
    if sender is TenantQuota:
        _limits_last.pop(instance.tenant_id, None)
    else:
        _limits_last.clear()


def _money_held(limits: Limits, ask: JobAsk) -> bool:
    """Whether admitting these jobs reserves money against a spend limit (a replica: its endpoint's hold)."""
    return limits.monthly_spend_limit is not None and ask.endpoint_id is None


def _limits_hinted(tenant: Tenant) -> Limits | None:
    """The tenant's limits as this process last read them under the lock, if less than ``LIMITS_HINT_S`` ago."""
    hint = _limits_last.get(tenant.pk)
    return hint[0] if hint is not None and time.monotonic() - hint[1] < LIMITS_HINT_S else None


def _exact_hinted(tenant: Tenant, ask: JobAsk) -> bool:
    """Whether this admission must see every other one of the tenant: an array or a money hold does, and so
    does a single job whose counts are within twice the in-flight bound of a limit. Judged by what this
    process last read of the tenant under the lock; a tenant it has not admitted yet is looked at first (its
    limits and counts, unlocked: one more statement, once)."""
    if connection.vendor != "postgresql" or ask.count > 1:
        return True
    limits, counts = _limits_hinted(tenant), _counts_last.get(tenant.pk)
    if limits is not None and counts is not None:
        open_jobs, queued = counts
    else:
        limits, open_jobs, queued = selectors.limits_and_job_counts(tenant)
    if _money_held(limits, ask):
        return True
    if limits.max_open_jobs is None and limits.max_queued_jobs is None:
        return False
    margin = 2 * in_flight_bound()
    return count_refusal(limits, open_jobs=open_jobs + margin, queued_jobs=queued + margin, count=1) is not None


def _counts_admitted(tenant: Tenant, limits: Limits, ask: JobAsk, *, open_jobs: int, queued: int, exact: bool) -> None:
    """Check the open/queued counts read under the lock: exactly (exclusive), or with room for every
    transaction that could be admitting alongside (shared)."""
    _counts_last[tenant.pk] = (open_jobs + ask.count, queued + ask.count)
    _raise(count_refusal(limits, open_jobs=open_jobs, queued_jobs=queued, count=ask.count))
    if exact:
        return
    room = in_flight_bound()
    if count_refusal(limits, open_jobs=open_jobs + room, queued_jobs=queued + room, count=ask.count) is not None:
        # Near a limit since the unlocked look (an array, another process's submits): this cannot be
        # proved to fit without waiting for the others, which a shared holder cannot do.
        raise AdmitAgain(
            "the tenant's job count reached the edge of its limit while this submit was admitted; retry it"
        )


def _raise(refusal: Refusal | None, error=JobError) -> None:
    if refusal is not None:
        raise error(refusal.message, code=refusal.code, field=refusal.field)


def _reads_more(limits: Limits) -> bool:
    """Whether admission reads more than the limits and counts (the month's usage; open holds): what a write
    sent with the first read would be seen by, and counted twice."""
    return limits.gpu_hours_per_month is not None or limits.monthly_spend_limit is not None


def _write_sent(tenant: Tenant, write: Callable[[], Write] | None) -> Write | None:
    """The write (made now), when it may go with the first read: on PostgreSQL, for a tenant this process last
    read (under the lock, less than ``LIMITS_HINT_S`` ago) with limits that need no read after it."""
    if write is None or connection.vendor != "postgresql":
        return None
    limits = _limits_hinted(tenant)
    return write() if limits is not None and not _reads_more(limits) else None


@acts_for_tenant
def job_admit(*, tenant: Tenant, ask: JobAsk, write: Callable[[], Write] | None = None) -> tuple | None:
    """Refuse ``ask.count`` jobs the tenant's limits or money budget forbid (raises ``JobError``).

    Order: state, size (can it ever fit), open and queued job counts, the month's GPU-hours
    and spend, then the money hold: the jobs' max cost must fit in what the budget has left
    after what is spent and what open holds reserve. A replica (``ask.endpoint_id``) is covered
    by its endpoint's hold. Two statements before any usage or hold, in one round trip: the locks,
    then the limits and counts under them.

    ``write`` (makes the submit's insert): sent in the statement of the limits and counts when nothing read
    after them could see it (``_write_sent``), and what it answered returned; else never made, None
    returned, and the caller writes. A refusal raises: the caller's transaction rolls back, the write with it.
    """
    exact = _exact_hinted(tenant, ask)
    sent = _write_sent(tenant, write)
    locked, limits, open_jobs, queued, written = _tenant_locked_with_limits(tenant, exact=exact, write=sent)
    if locked.state != Tenant.State.ACTIVE:
        raise JobError(f"tenant {locked.slug} is {locked.state} and cannot submit jobs", code="forbidden")
    _limits_last[locked.pk] = (limits, time.monotonic())
    _raise(size_refusal(limits, mode=ask.mode, gpu_milli=ask.gpu_milli))
    if not exact and _money_held(limits, ask):
        raise AdmitAgain("the tenant's spend limit was set while this submit was admitted; retry it")
    if sent is not None and _reads_more(limits):
        # Set since this process last read the limits: the usage and hold reads would count the write.
        raise AdmitAgain("the tenant's GPU-hour or spend limit was set while this submit was admitted; retry it")
    _counts_admitted(locked, limits, ask, open_jobs=open_jobs, queued=queued, exact=exact)
    if not _reads_more(limits):
        return written
    usage = selectors.month_usage(locked)
    _raise(budget_refusal(limits, usage))
    if ask.endpoint_id is not None or limits.monthly_spend_limit is None:
        return None
    prices = selectors.prices_now()
    hold = ask.count * selectors.job_hold(
        prices,
        mode=ask.mode,
        gpu_model=ask.gpu_model,
        gpu_milli=ask.gpu_milli,
        max_runtime_s=ask.max_runtime_s,
        multiplier=Decimal(ask.price_multiplier),
    )
    budget = selectors.budget_now(locked, limits, usage=usage, prices=prices)
    what = "this job" if ask.count == 1 else f"this array of {ask.count} tasks"
    _raise(hold_refusal(budget, hold=hold, what=what))
    return None


@acts_for_tenant
def endpoint_admit(
    *, tenant: Tenant, endpoint_id: int | None, gpu_milli: int, gpu_model: str, priority: str, max_replicas: int
) -> None:
    """Refuse an endpoint (new: ``endpoint_id`` None) the limits or the money budget forbid (``EndpointError``).

    The hold of an endpoint is its max replicas × its size × ``ENDPOINT_HOLD_HORIZON_S`` at its price.
    """
    locked = _tenant_locked(tenant.pk, exact=True)
    limits = limits_for(locked)
    count = selectors.endpoint_count(locked, exclude_id=endpoint_id)
    _raise(endpoint_refusal(limits, endpoints=count, max_replicas=max_replicas, new=endpoint_id is None), EndpointError)
    if limits.monthly_spend_limit is None:
        return
    prices = selectors.prices_now()
    hold = selectors.endpoint_hold(
        prices,
        gpu_milli=gpu_milli,
        gpu_model=gpu_model,
        max_replicas=max_replicas,
        multiplier=selectors._multiplier(priority),
    )
    budget = selectors.budget_now(locked, limits, prices=prices, exclude_endpoint_id=endpoint_id)
    hours = selectors.hold_horizon_s() / 3600
    _raise(
        hold_refusal(budget, hold=hold, what=f"this endpoint ({max_replicas} replicas for {hours:g} h)"), EndpointError
    )


def log_limit_for(*, tenant_id: int) -> int | None:
    return limits_for(Tenant(pk=tenant_id)).max_log_bytes_per_job


# --- month totals and the budget beat -----------------------------------------------------------------

# A usage window's transaction commits within the Celery task time limit (300 s) of its
# insert, so every window with an id at most that of a row received this long ago is visible.
SETTLED_AFTER = timedelta(minutes=10)
# Agent clocks may run ahead: a window received before the month (less this) cannot start in it.
CLOCK_MARGIN = timedelta(hours=1)


@scopes_disabled()  # platform-wide: folds every given tenant's windows
def month_usage_advance(tenant_ids, *, now: datetime | None = None) -> int:
    """Fold the settled windows of this month into ``TenantMonthUsage`` (call in a transaction;
    idempotent). Returns the window id the totals now run through."""
    now = now or timezone.now()
    start = selectors.month_start(now)
    start_ms, end_ms = selectors.month_bounds_ms(now)
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
        added = selectors.window_sums(
            UsageWindow.objects.filter(
                id__gt=cursor,
                id__lte=settled,
                tenant_id__in=[r.tenant_id for r in group],
                start_ms__gte=start_ms,
                start_ms__lt=end_ms,
            )
        )
        for row in group:
            total = selectors.usage_add(MonthUsage(gpu_ms=row.gpu_ms, spend=row.spend), added.get(row.tenant_id))
            row.gpu_ms, row.spend, row.through_window_id = total.gpu_ms, total.spend, settled
            row.save(update_fields=["gpu_ms", "spend", "through_window_id", "updated_at"])
    return settled


def budgets_enforce(*, now=None) -> dict:
    """Platform-wide, safe to run twice: alert once a month at the threshold, and stop
    running jobs of tenants whose month budget is exhausted when the setting says stop.
    Only tenants with a GPU-hour or spend limit are looked at; each in its own transaction."""
    with scopes_disabled():  # the beat acts for every budgeted tenant
        budgeted = selectors.budgeted_tenants()
        with transaction.atomic():
            month_usage_advance(list(budgeted), now=now)
        usages = selectors.month_usages(list(budgeted), now=now) if budgeted else {}
        result = {"alerted": 0, "stopped": 0}
        for tenant in Tenant.objects.filter(pk__in=list(budgeted)):
            alerted, stopped = _budget_enforce_one(tenant=tenant, usage=usages.get(tenant.pk, MonthUsage()), now=now)
            result["alerted"] += alerted
            result["stopped"] += stopped
    return result


@acts_for_tenant
@transaction.atomic
def _budget_enforce_one(*, tenant: Tenant, usage: MonthUsage, now=None) -> tuple[int, int]:
    from django.core.mail import send_mail

    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
    limits = limits_for(tenant)
    alerted = stopped = 0
    since = selectors.month_start(now)
    if (
        alert_due(limits, usage)
        and not AuditLog.objects.filter(tenant=tenant, action="budget.alert", created_at__gte=since).exists()
    ):
        status = {"gpu_ms": usage.gpu_ms, "spend": str(usage.spend), "alert_percent": limits.budget_alert_percent}
        audit_record(actor=None, tenant=tenant, action="budget.alert", target=tenant.slug, after=status)
        webhook_emit.budget(tenant, kind="threshold", month=since, status=status)
        if tenant.billing_email:
            transaction.on_commit(
                lambda: send_mail(
                    f"gpushare: {tenant.name} reached {limits.budget_alert_percent}% of its monthly budget",
                    f"This month so far: {usage.gpu_ms / MS_PER_HOUR:.3f} GPU-hours, spend {usage.spend:.2f}.\n"
                    f"Limits: {limits.gpu_hours_per_month or 'none'} GPU-hours, "
                    f"{limits.monthly_spend_limit or 'no'} spend limit.\n",
                    None,
                    [tenant.billing_email],
                )
            )
        alerted = 1
    refusal = budget_refusal(limits, usage)
    if refusal is not None:
        webhook_emit.budget(tenant, kind="exhausted", month=since, status={"reason": refusal.message.split(";")[0]})
    if refusal is not None and limits.on_budget_exhausted == RunningJobsPolicy.STOP:
        stopped = running_jobs_stop(tenant=tenant, reason=f"stopped: {refusal.message.split(';')[0]}")
        if stopped:
            audit_record(
                actor=None, tenant=tenant, action="budget.stop_jobs", target=tenant.slug, after={"stopped": stopped}
            )
    return alerted, stopped
