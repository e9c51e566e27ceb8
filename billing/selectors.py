"""Read queries for prices, usage, spend, estimates and invoices."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db.models import BigIntegerField, Count, ExpressionWrapper, F, Max, Min, Q, Sum, Value

from accounts.models import Tenant
from accounts.selectors import limits_for
from agents.models import Gpu, GpuOutage
from scheduler.models import MILLI_PER_GPU, Allocation, PriorityClass

from . import ledger, rating
from .models import Charge, Invoice, InvoiceLine, Price

MONTH_RE = re.compile(r"^(\d{4})-(\d{2})$")


def month_parse(value: str) -> date:
    """'2026-03' -> date(2026, 3, 1); a clear ValueError otherwise."""
    m = MONTH_RE.match(value or "")
    if not m or not 1 <= int(m.group(2)) <= 12:
        raise ValueError(f"month must look like YYYY-MM (e.g. 2026-03), got {value!r}")
    return date(int(m.group(1)), int(m.group(2)), 1)


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def price_at(*, gpu_model: str, mode: str, at_ms: int) -> Price | None:
    """The price in force for ``gpu_model`` in ``mode`` at ``at_ms``."""
    at = datetime.fromtimestamp(at_ms / 1000, tz=UTC)
    return (
        Price.objects.filter(gpu_model=gpu_model, mode=mode, effective_from__lte=at).order_by("-effective_from").first()
    )


# --- spend ----------------------------------------------------------------


def tenant_month_spend(*, tenant: Tenant, at: datetime) -> Decimal:
    """What the tenant has been charged (exact, unrounded) in ``at``'s month up to ``at``.

    Usage is metered in windows of about a minute, so this is current to the
    last window the agents reported. Accounts' budget enforcement calls this.
    """
    at_ms = _ms(at)
    month = rating.month_of(at_ms)
    total = Charge.objects.filter(tenant=tenant, month=month, start_ms__lt=at_ms).aggregate(s=Sum("amount"))["s"]
    return total or Decimal(0)


@dataclass(frozen=True)
class SpendSummary:
    month: date
    spent: Decimal  # rounded to cents
    projected: Decimal  # spent + the last hour's rate until month end
    limit: Decimal | None
    alert_percent: int | None
    alert: bool  # spend reached the alert threshold of the limit


def spend_summary(*, tenant: Tenant, at: datetime) -> SpendSummary:
    """Spend so far this month, the projected month end and the budget alert flag.

    Projection: what is spent, plus the last hour's spend rate for the rest of
    the month ("if what runs now keeps running"); a tenant with nothing running
    is projected at what it has spent. The limit and alert percent are the
    accounts quota's (``accounts.selectors.limits_for``); admission sends the
    alert email and enforces the limit.
    """
    at_ms = _ms(at)
    month = rating.month_of(at_ms)
    _, end = rating.month_bounds_ms(month)
    spent = tenant_month_spend(tenant=tenant, at=at)
    last_hour = Charge.objects.filter(
        tenant=tenant, start_ms__gte=at_ms - rating.MS_PER_HOUR, start_ms__lt=at_ms
    ).aggregate(s=Sum("amount"))["s"] or Decimal(0)
    projected = spent + last_hour * (end - at_ms) / rating.MS_PER_HOUR
    limits = limits_for(tenant)
    limit, percent = limits.monthly_spend_limit, limits.budget_alert_percent
    alert = limit is not None and percent is not None and spent >= limit * Decimal(percent) / 100
    return SpendSummary(
        month=month,
        spent=rating.line_round(spent),
        projected=rating.line_round(projected),
        limit=limit,
        alert_percent=percent,
        alert=alert,
    )


# --- estimates --------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    gpu_model: str
    mode: str
    priority: str
    gpu_milli: int
    max_runtime_s: int
    per_gpu_hour: Decimal
    multiplier: Decimal
    per_hour: Decimal  # for the whole request, rounded to cents
    max_cost: Decimal  # if it runs the full max runtime


class EstimateError(ValueError):
    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def job_estimate(
    *, gpu_milli: int, max_runtime_s: int, priority: PriorityClass, gpu_model: str = "", at: datetime
) -> list[Estimate]:
    """Cost of a request before it runs, at the prices in force at ``at``.

    Without ``gpu_model`` one estimate per model priced for the mode, cheapest
    first. Whole GPUs are dedicated, a fraction is a shared slice.
    """
    if gpu_milli <= 0 or (gpu_milli > MILLI_PER_GPU and gpu_milli % MILLI_PER_GPU):
        raise EstimateError("gpus must be a fraction up to 1 (e.g. 0.25) or a whole number", "gpus")
    mode = "dedicated" if gpu_milli % MILLI_PER_GPU == 0 else "shared"
    prices = Price.objects.filter(mode=mode, effective_from__lte=at).order_by("gpu_model", "-effective_from")
    if gpu_model:
        prices = prices.filter(gpu_model=gpu_model)
    current: dict[str, Price] = {}
    for p in prices:
        current.setdefault(p.gpu_model, p)
    if not current:
        raise EstimateError(f"no {mode} price for {gpu_model or 'any GPU model'}", "gpu_model")
    out = []
    for model, p in current.items():
        per_hour = rating.job_estimate_amount(
            gpu_milli=gpu_milli, seconds=3600, per_gpu_hour=p.per_gpu_hour, multiplier=priority.price_multiplier
        )
        out.append(
            Estimate(
                gpu_model=model,
                mode=mode,
                priority=priority.name,
                gpu_milli=gpu_milli,
                max_runtime_s=max_runtime_s,
                per_gpu_hour=p.per_gpu_hour,
                multiplier=priority.price_multiplier,
                per_hour=per_hour,
                max_cost=rating.job_estimate_amount(
                    gpu_milli=gpu_milli,
                    seconds=max_runtime_s,
                    per_gpu_hour=p.per_gpu_hour,
                    multiplier=priority.price_multiplier,
                ),
            )
        )
    return sorted(out, key=lambda e: (e.max_cost, e.gpu_model))


# --- usage ------------------------------------------------------------------

USAGE_GROUPS = ("day", "job", "gpu_model")
MS_PER_DAY = 86_400_000
EPOCH = date(1970, 1, 1)


def usage_summary(*, tenant: Tenant, start: datetime, end: datetime, group_by: str) -> list[dict]:
    """Held GPU-seconds, used (SM-utilisation) GPU-seconds and cost per day, job or GPU model.

    Charges are split at month boundaries only, so a charge is counted in the
    range if it starts in it (windows are about a minute long).
    """
    if group_by not in USAGE_GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(USAGE_GROUPS)}")
    qs = Charge.objects.filter(tenant=tenant, start_ms__gte=_ms(start), start_ms__lt=_ms(end))
    if group_by == "day":  # whole UTC days since the epoch (integer division, in any database)
        qs = qs.annotate(key=ExpressionWrapper(F("start_ms") / Value(MS_PER_DAY), output_field=BigIntegerField()))
    else:
        qs = qs.annotate(key=F("job_id" if group_by == "job" else "gpu_model"))
    rows = (
        qs.values("key")
        .annotate(gpu_ms=Sum("gpu_ms"), sm=Sum("sm_util_ms"), amount=Sum("amount"), charges=Count("id"))
        .order_by("key")
    )
    return [
        {
            group_by: (EPOCH + timedelta(days=r["key"])).isoformat() if group_by == "day" else r["key"],
            "held_gpu_seconds": Decimal(r["gpu_ms"]) / 1000,
            "used_gpu_seconds": Decimal(r["sm"]) / 1000,
            "cost": r["amount"],  # exact: the API never rounds money (invoices round per line)
        }
        for r in rows
    ]


# --- invoices ---------------------------------------------------------------


def invoices_for_tenant(*, tenant: Tenant):
    return Invoice.objects.filter(tenant=tenant).annotate(line_count=Count("lines")).order_by("-month", "-id")


def invoice_with_lines_for_operator(*, invoice_id: int) -> Invoice | None:
    """Any tenant's invoice: the operator's console only (call inside ``scopes_disabled``)."""
    return Invoice.objects.filter(pk=invoice_id).select_related("tenant").prefetch_related("lines").first()


def invoice_with_lines(*, tenant: Tenant, invoice_id: int) -> Invoice | None:
    """The tenant's invoice with its lines; None for a missing id and for another tenant's."""
    return (
        Invoice.objects.filter(tenant=tenant, pk=invoice_id).select_related("tenant").prefetch_related("lines").first()
    )


@dataclass(frozen=True)
class LineView:
    line: InvoiceLine
    gpu_hours: Decimal
    sm_util_hours: Decimal
    memory_gb_seconds: Decimal
    energy_kwh: Decimal


def line_figures(line: InvoiceLine) -> LineView:
    """The metered figures shown beside a line, in the units a person reads."""
    return LineView(
        line=line,
        gpu_hours=(Decimal(line.gpu_ms) / rating.MS_PER_HOUR).quantize(Decimal("0.0001")),
        sm_util_hours=(Decimal(line.sm_util_ms) / rating.MS_PER_HOUR).quantize(Decimal("0.0001")),
        memory_gb_seconds=(Decimal(line.memory_mb_ms) / 1024 / 1000).quantize(Decimal("0.01")),
        energy_kwh=(Decimal(line.energy_mj) / Decimal(3_600_000_000)).quantize(Decimal("0.0001")),
    )


def invoice_lines_display(*, invoice: Invoice) -> list[LineView]:
    return [line_figures(line) for line in invoice.lines.all()]


INVOICE_CSV_COLUMNS = (
    "job_id",
    "job_name",
    "gpu_model",
    "mode",
    "priority_class",
    "rate_per_gpu_hour",
    "first_start_utc",
    "last_end_utc",
    "gpu_seconds",
    "sm_util_seconds",
    "memory_gb_seconds",
    "energy_kwh",
    "exact_amount",
)


def invoice_job_rows(*, invoice: Invoice):
    """Per job × line key: what the job held and was charged on this invoice (exact amounts)."""
    rows = (
        Charge.objects.filter(tenant_id=invoice.tenant_id, batch__invoice=invoice)
        .values("job_id", "job__name", "gpu_model", "mode", "priority_class", "rate_per_gpu_hour")
        .annotate(
            first=Min("start_ms"),
            last=Max("end_ms"),
            gpu_ms=Sum("gpu_ms"),
            sm=Sum("sm_util_ms"),
            mem=Sum("memory_mb_ms"),
            energy=Sum("energy_mj"),
            amount=Sum("amount"),
        )
        .order_by("job_id", "gpu_model", "mode", "priority_class", "rate_per_gpu_hour")
    )
    for r in rows:
        yield (
            r["job_id"],
            r["job__name"],
            r["gpu_model"],
            r["mode"],
            r["priority_class"],
            r["rate_per_gpu_hour"],
            datetime.fromtimestamp(r["first"] / 1000, tz=UTC).isoformat(),
            datetime.fromtimestamp(r["last"] / 1000, tz=UTC).isoformat(),
            Decimal(r["gpu_ms"]) / 1000,
            Decimal(r["sm"]) / 1000,
            (Decimal(r["mem"]) / 1024 / 1000).quantize(Decimal("0.001")),
            (Decimal(r["energy"]) / Decimal(3_600_000_000)).quantize(Decimal("0.000001")),
            r["amount"],
        )


# --- the ledger ---------------------------------------------------------------


@dataclass
class LedgerReport:
    month: date
    start_ms: int
    end_ms: int
    gpus: list[ledger.GpuLedger]
    problems: list[str]

    @property
    def by_model(self) -> list[ledger.LedgerTotals]:
        return ledger.totals_by(self.gpus, lambda g: g.model)

    @property
    def by_node(self) -> list[ledger.LedgerTotals]:
        return ledger.totals_by(self.gpus, lambda g: g.node)

    @property
    def total(self) -> ledger.LedgerTotals:
        return ledger.totals_by(self.gpus, lambda g: "all")[0] if self.gpus else None


def _dt_ms(value: datetime | None) -> int | None:
    return int(value.timestamp() * 1000) if value is not None else None


def ledger_month(*, month: date, until: datetime | None = None) -> LedgerReport:
    """Every GPU-second of ``month`` (up to ``until`` if earlier): held, idle, out of service; and what breaks it.

    A GPU counts from its registration if later than the month start; its
    registration is the earliest of the node's ``registered_at``, its first
    allocation and its first outage (the node's field moves on re-registration).
    Billed time comes from the month's charges, put on GPUs through the job's
    allocations on the charge's node.
    """
    start_ms, end_ms = rating.month_bounds_ms(month)
    if until is not None:
        end_ms = min(end_ms, _dt_ms(until))
    start_at = datetime.fromtimestamp(start_ms / 1000, tz=UTC)
    end_at = datetime.fromtimestamp(end_ms / 1000, tz=UTC)

    gpus = {g.pk: g for g in Gpu.objects.select_related("node")}
    first_seen: dict[int, int] = {}

    def seen(gpu_id: int, at_ms: int | None) -> None:
        if at_ms is not None:
            first_seen[gpu_id] = min(first_seen.get(gpu_id, at_ms), at_ms)

    for g in gpus.values():
        seen(g.pk, _dt_ms(g.node.registered_at))
    for gpu_id, first in Allocation.objects.values_list("gpu_id").annotate(first=Min("created_at")):
        seen(gpu_id, _dt_ms(first))
    outages: dict[int, list[tuple[int, int]]] = {}
    for gpu_id, started, ended in GpuOutage.objects.filter(started_at__lt=end_at).values_list(
        "gpu_id", "started_at", "ended_at"
    ):
        seen(gpu_id, _dt_ms(started))
        ended_ms = _dt_ms(ended) if ended is not None else end_ms
        if ended_ms > start_ms:
            outages.setdefault(gpu_id, []).append((_dt_ms(started), ended_ms))

    allocations: dict[tuple[int, int], list[tuple[int, int, int, int | None]]] = {}
    live = Allocation.objects.filter(created_at__lt=end_at).filter(
        Q(released_at__isnull=True) | Q(released_at__gt=start_at)
    )
    for job_id, gpu_id, node_id, share, created, released in live.values_list(
        "job_id", "gpu_id", "gpu__node_id", "share_milli", "created_at", "released_at"
    ):
        allocations.setdefault((job_id, node_id), []).append((gpu_id, share, _dt_ms(created), _dt_ms(released)))

    held: dict[int, list[ledger.Held]] = {}
    metered: list[ledger.Metered] = []
    problems: list[str] = []
    charges = Charge.objects.filter(month=month, end_ms__lte=end_ms).values_list(
        "job_id", "window__node_id", "window__attempt", "start_ms", "end_ms", "amount"
    )
    for job_id, node_id, attempt, c_start, c_end, amount in charges.iterator(chunk_size=5000):
        metered.append(ledger.Metered(job_id, node_id, attempt, c_start, c_end))
        on = [a for a in allocations.get((job_id, node_id), []) if a[2] < c_end and (a[3] is None or a[3] > c_start)]
        if not on:
            if len(problems) < 50:
                problems.append(f"unattributed: job {job_id} billed [{c_start}, {c_end}) with no allocation there")
            continue
        shares = sum(a[1] for a in on)
        for gpu_id, share, _, _ in on:
            held.setdefault(gpu_id, []).append(ledger.Held(c_start, c_end, share, job_id, amount * share / shares))

    ledgers = []
    for gpu_id, gpu in sorted(gpus.items(), key=lambda kv: (kv[1].node.name, kv[1].index)):
        since = max(start_ms, first_seen.get(gpu_id, end_ms))
        if since >= end_ms:
            continue
        ledgers.append(
            ledger.gpu_ledger(
                gpu_id=gpu_id,
                node=gpu.node.name,
                model=gpu.model,
                start_ms=since,
                end_ms=end_ms,
                held=held.get(gpu_id, []),
                outages=outages.get(gpu_id, []),
            )
        )
    problems += [p for g in ledgers for p in g.problems]
    problems += ledger.metering_gaps(metered)
    return LedgerReport(month=month, start_ms=start_ms, end_ms=end_ms, gpus=ledgers, problems=problems)


def model_prices(*, at) -> dict[str, float]:
    """GPU model -> price of a dedicated GPU-hour in force at ``at`` (the placement core's price term:
    the cheapest fitting model first for a job that names none). Models without a price are absent."""
    prices: dict[str, float] = {}
    rows = (
        Price.objects.filter(mode=Price.Mode.DEDICATED, effective_from__lte=at)
        .order_by("gpu_model", "-effective_from")
        .values_list("gpu_model", "per_gpu_hour")
    )
    for model, price in rows:
        prices.setdefault(model, float(price))
    return prices
