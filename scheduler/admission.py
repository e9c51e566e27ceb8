"""What the scheduler asks of the admission layer (``admission/``), which provides it at start-up.

The scheduler never imports the admission app (it sits above: ``.importlinter``); a call to a
port nobody provided raises ``ImproperlyConfigured`` instead of admitting everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.ports import Port


@dataclass(frozen=True)
class JobAsk:
    """What admission needs to know about ``count`` jobs of one shape."""

    kind: str
    mode: str
    gpu_milli: int
    max_runtime_s: int
    price_multiplier: object  # Decimal: the priority class's price multiplier
    gpu_model: str = ""
    count: int = 1
    endpoint_id: int | None = None  # a replica: the endpoint's hold covers it


@dataclass(frozen=True)
class Write:
    """The submit's insert, for admission to send in the statement that reads the tenant's limits and counts
    under its locks: one round trip less per submit (PostgreSQL). ``ctes``: the WITH items that write
    (``j AS (INSERT ... RETURNING ...)``), then ``select``, a SELECT over them naming ``columns``, which
    answers one row, or none when the insert's own condition did not hold; ``params``: their ``%s`` values,
    in order. What the read sees is what it would on its own (one snapshot for the whole statement: not
    the write); a refusal raises, and the caller's transaction, rolled back, takes the write with it."""

    ctes: str
    select: str
    columns: tuple[str, ...]
    params: tuple


@dataclass(frozen=True)
class TenantCaps:
    """What a tenant may hold at once (None: no limit); ``blocked_reason``: nothing may start now."""

    max_dedicated_gpus: int | None
    max_shared_milli: int | None
    blocked_reason: str = ""


job_admit = Port(
    "scheduler.job_admit",
    "job_admit(*, tenant, ask: JobAsk, write: Callable[[], Write] | None = None) -> tuple | None: raise JobError "
    "unless the tenant may submit these jobs now; called inside job_submit's transaction, it may lock and reserve "
    "(money holds) until commit. With ``write`` (made only if sent): the write's row (its columns' values, all None "
    "when its condition did not hold) if it was sent with the read, None if not (the caller writes)",
)
tenant_caps = Port(
    "scheduler.tenant_caps",
    "tenant_caps() -> {tenant_id: TenantCaps}: per-tenant caps for a scheduling pass",
)
log_limit = Port(
    "scheduler.log_limit",
    "log_limit(*, tenant_id) -> int | None: log bytes kept per job (older output is rotated off)",
)
