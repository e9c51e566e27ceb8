"""Limit arithmetic: plain data in, plain data out. No Django (``.importlinter`` keeps it so).

The bottom of the admission stack: ``accounts.selectors.limits_for`` reads the rows (a tenant's
quota, its plan, the ``default`` plan) into :class:`Limits` with :func:`limits_merge`; the
admission app (``admission/``) counts what the tenant holds and has spent and asks the functions
here whether one more job, endpoint or request fits. Every refusal names the limit and its value.

Money is Decimal; time is integer milliseconds (or whole seconds where the field says so).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from decimal import ROUND_CEILING, Decimal

MS_PER_HOUR = 3_600_000
MILLI_PER_GPU = 1000
DEFAULT_ALERT_PERCENT = 80
STOP = "stop"  # accounts.models.RunningJobsPolicy.STOP

QUOTA_EXCEEDED = "quota_exceeded"
BUDGET_EXHAUSTED = "budget_exhausted"
HOLD_REFUSED = "budget_exceeded"  # the new job's hold does not fit in what is left of the budget

# What every tenant gets when neither its quota, its plan nor the ``default`` plan sets a value
# (docs/accounts.md, "Plan defaults"). An operator lifts one by setting a larger value on a plan
# or a tenant's quota; None here means the limit is off unless a plan sets it.
PLAN_DEFAULTS: dict[str, int | None] = {
    "max_open_jobs": 10_000,  # queued + placed + running: one full job array and change
    "max_queued_jobs": 10_000,
    "max_endpoints": 10,
    "max_replicas_per_endpoint": 8,
    "max_log_bytes_per_job": 16 * 1024 * 1024,  # older output is rotated off beyond this
    "api_requests_per_minute": 600,  # per tenant, all tokens and sessions and web processes together
    "max_disk_mb_per_job": 50 * 1024,  # scratch space on the node (enforced by the agent, issue #15)
}


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits; None means no limit."""

    max_dedicated_gpus: int | None = None
    max_shared_milli: int | None = None
    max_gpus_per_job: int | None = None
    max_open_jobs: int | None = None
    max_queued_jobs: int | None = None
    max_endpoints: int | None = None
    max_replicas_per_endpoint: int | None = None
    max_log_bytes_per_job: int | None = None
    api_requests_per_minute: int | None = None
    max_disk_mb_per_job: int | None = None
    gpu_hours_per_month: Decimal | None = None
    monthly_spend_limit: Decimal | None = None
    budget_alert_percent: int = DEFAULT_ALERT_PERCENT
    on_budget_exhausted: str = STOP
    on_suspended: str = STOP


LIMIT_NAMES = tuple(f.name for f in fields(Limits))


@dataclass(frozen=True)
class MonthUsage:
    gpu_ms: int = 0
    spend: Decimal = Decimal(0)


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    field: str | None = None  # the request field at fault, when it is the job's size
    limit: str | None = None  # the limit's name


def limits_merge(*layers) -> Limits:
    """The first non-empty value of each field, from the most specific layer down, then ``PLAN_DEFAULTS``.

    A layer is anything with the limit names as attributes (a model row, a dict wrapper) or None.
    """
    values = {}
    for name in LIMIT_NAMES:
        for layer in layers:
            value = getattr(layer, name, None) if layer is not None else None
            if value not in (None, ""):
                values[name] = value
                break
        else:
            if PLAN_DEFAULTS.get(name) is not None:
                values[name] = PLAN_DEFAULTS[name]
    return Limits(**values)


# --- jobs -------------------------------------------------------------------------------------------


def budget_refusal(limits: Limits, usage: MonthUsage) -> Refusal | None:
    if limits.gpu_hours_per_month is not None and usage.gpu_ms >= limits.gpu_hours_per_month * MS_PER_HOUR:
        used = Decimal(usage.gpu_ms) / MS_PER_HOUR
        return Refusal(
            BUDGET_EXHAUSTED,
            f"this month's GPU-hours are used up ({used:.3f} of the limit gpu_hours_per_month="
            f"{limits.gpu_hours_per_month}); new jobs are refused until next month or a higher limit",
            limit="gpu_hours_per_month",
        )
    if limits.monthly_spend_limit is not None and usage.spend >= limits.monthly_spend_limit:
        return Refusal(
            BUDGET_EXHAUSTED,
            f"this month's spend limit is reached ({usage.spend:.2f} of monthly_spend_limit="
            f"{limits.monthly_spend_limit}); new jobs are refused until next month or a higher limit",
            limit="monthly_spend_limit",
        )
    return None


def size_refusal(limits: Limits, *, mode: str, gpu_milli: int) -> Refusal | None:
    """A job of this size can never start under these limits."""
    gpus = max(1, gpu_milli // MILLI_PER_GPU)
    if limits.max_gpus_per_job is not None and gpus > limits.max_gpus_per_job:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpus} GPUs; the limit max_gpus_per_job is {limits.max_gpus_per_job}",
            "gpus",
            "max_gpus_per_job",
        )
    if mode == "dedicated" and limits.max_dedicated_gpus is not None and gpus > limits.max_dedicated_gpus:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpus} dedicated GPUs; the limit max_dedicated_gpus (held at once) is "
            f"{limits.max_dedicated_gpus}, so it could never start",
            "gpus",
            "max_dedicated_gpus",
        )
    if mode == "shared" and limits.max_shared_milli is not None and gpu_milli > limits.max_shared_milli:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the job asks for {gpu_milli / MILLI_PER_GPU:g} of a shared GPU; the limit max_shared_capacity "
            f"(held at once) is {limits.max_shared_milli / MILLI_PER_GPU:g}, so it could never start",
            "gpus",
            "max_shared_milli",
        )
    return None


def count_refusal(limits: Limits, *, open_jobs: int, queued_jobs: int, count: int = 1) -> Refusal | None:
    """``count`` more jobs would pass the open or queued job limit."""
    tasks = "" if count == 1 else f"the array has {count} tasks and "
    if limits.max_open_jobs is not None and open_jobs + count > limits.max_open_jobs:
        return Refusal(
            QUOTA_EXCEEDED,
            f"{tasks}the tenant already has {open_jobs} unfinished jobs; the limit max_open_jobs is "
            f"{limits.max_open_jobs}",
            limit="max_open_jobs",
        )
    if limits.max_queued_jobs is not None and queued_jobs + count > limits.max_queued_jobs:
        return Refusal(
            QUOTA_EXCEEDED,
            f"{tasks}the tenant already has {queued_jobs} queued jobs; the limit max_queued_jobs is "
            f"{limits.max_queued_jobs}",
            limit="max_queued_jobs",
        )
    return None


def admission_refusal(
    limits: Limits, usage: MonthUsage, *, open_jobs: int, mode: str, gpu_milli: int, queued_jobs: int = 0, count=1
) -> Refusal | None:
    """Why ``count`` jobs of this size may not be submitted now (size, counts, exhausted budget), or None."""
    return (
        size_refusal(limits, mode=mode, gpu_milli=gpu_milli)
        or count_refusal(limits, open_jobs=open_jobs, queued_jobs=queued_jobs, count=count)
        or budget_refusal(limits, usage)
    )


def alert_due(limits: Limits, usage: MonthUsage) -> bool:
    """Usage has reached the alert threshold of a GPU-hour or spend limit."""
    share = Decimal(limits.budget_alert_percent) / 100
    if limits.gpu_hours_per_month is not None and usage.gpu_ms >= limits.gpu_hours_per_month * MS_PER_HOUR * share:
        return True
    return limits.monthly_spend_limit is not None and usage.spend >= limits.monthly_spend_limit * share


# --- money holds ------------------------------------------------------------------------------------

CENT = Decimal("0.01")


def max_cost(*, gpu_milli: int, seconds: int, per_gpu_hour: Decimal, multiplier: Decimal = Decimal(1)) -> Decimal:
    """The most a job can cost: its GPUs for ``seconds`` at the price, rounded *up* to the cent."""
    amount = Decimal(gpu_milli) * seconds * per_gpu_hour * multiplier / (MILLI_PER_GPU * 3600)
    return amount.quantize(CENT, rounding=ROUND_CEILING)


def hold_open(*, amount: Decimal, metered: Decimal) -> Decimal:
    """What a hold still reserves once ``metered`` of it has been charged: it shrinks, never below 0."""
    return max(amount - metered, Decimal(0))


@dataclass(frozen=True)
class Budget:
    """A money budget at one instant: the limit, what is charged and what open holds reserve."""

    limit: Decimal
    spent: Decimal
    held: Decimal

    @property
    def left(self) -> Decimal:
        return max(self.limit - self.spent - self.held, Decimal(0))


def hold_refusal(budget: Budget | None, *, hold: Decimal, what: str = "this job") -> Refusal | None:
    """Refuse a new hold that does not fit in what is left: held + spent never passes the limit."""
    if budget is None or budget.spent + budget.held + hold <= budget.limit:
        return None
    return Refusal(
        HOLD_REFUSED,
        f"{what} can cost up to ${hold:,.2f}; ${budget.left:,.2f} of your ${budget.limit:,.2f} budget is left "
        f"(${budget.spent:,.2f} spent, ${budget.held:,.2f} held by running and queued work; "
        f"the limit monthly_spend_limit)",
        limit="monthly_spend_limit",
    )


# --- endpoints and requests -------------------------------------------------------------------------


def endpoint_refusal(limits: Limits, *, endpoints: int, max_replicas: int, new: bool) -> Refusal | None:
    if new and limits.max_endpoints is not None and endpoints + 1 > limits.max_endpoints:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the tenant already has {endpoints} endpoints; the limit max_endpoints is {limits.max_endpoints}",
            limit="max_endpoints",
        )
    if limits.max_replicas_per_endpoint is not None and max_replicas > limits.max_replicas_per_endpoint:
        return Refusal(
            QUOTA_EXCEEDED,
            f"max_replicas is {max_replicas}; the limit max_replicas_per_endpoint is "
            f"{limits.max_replicas_per_endpoint}",
            "max_replicas",
            "max_replicas_per_endpoint",
        )
    return None


def log_keep_from(*, total: int, limit: int | None, chunks: list[tuple[int, int]]) -> int | None:
    """Rotation: the offset from which a job's log output is kept so that at most ``limit`` bytes remain.

    ``chunks`` are (offset, length) in offset order; whole chunks are dropped from the front.
    None: nothing to drop.
    """
    if limit is None or total <= limit:
        return None
    excess = total - limit
    dropped = 0
    for offset, length in chunks:
        if dropped >= excess:
            return offset
        dropped += length
    return None if not chunks else chunks[-1][0] + chunks[-1][1]
