"""Pure rating: usage → money. No Django.

A price is per GPU-hour; usage is GPU-milliseconds (wall time × GPUs held,
× the fraction for a shared slice). A window is rated piece by piece: it is
split wherever the price, the tenant's discount or the calendar month (UTC)
changes inside it, and each piece is rated with what was in force then, so a
price change never rewrites past usage.

Amounts are exact to 10 decimal places per piece; invoices round once per
line, ROUND_HALF_UP to cents (see docs/billing.md).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

MS_PER_HOUR = 3_600_000
EXACT = Decimal("0.0000000001")
CENT = Decimal("0.01")
HUNDRED = Decimal(100)


def window_amount(*, gpu_ms: int, per_gpu_hour: Decimal, multiplier: Decimal = Decimal(1)) -> Decimal:
    """Charge for ``gpu_ms`` allocated GPU-milliseconds at ``per_gpu_hour``."""
    if gpu_ms < 0:
        raise ValueError("gpu_ms must not be negative")
    return (Decimal(gpu_ms) * per_gpu_hour * multiplier / MS_PER_HOUR).quantize(EXACT, rounding=ROUND_HALF_EVEN)


def allocated_gpu_ms(*, start_ms: int, end_ms: int, gpu_milli: int) -> int:
    """GPU-milliseconds held over a window: wall time × GPUs (thousandths)."""
    return (end_ms - start_ms) * gpu_milli // 1000


def line_round(amount: Decimal) -> Decimal:
    """The one rounding step: an invoice line's exact amount to cents, half up."""
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)


def effective_rate(*, per_gpu_hour: Decimal, multiplier: Decimal, discount_pct: Decimal) -> Decimal:
    """Price per GPU-hour after the class multiplier and the tenant's discount (exact)."""
    return per_gpu_hour * multiplier * (HUNDRED - discount_pct) / HUNDRED


# --- calendar -------------------------------------------------------------


def month_of(at_ms: int) -> date:
    at = datetime.fromtimestamp(at_ms / 1000, tz=UTC)
    return date(at.year, at.month, 1)


def month_start_ms(month: date) -> int:
    return int(datetime(month.year, month.month, 1, tzinfo=UTC).timestamp() * 1000)


def next_month(month: date) -> date:
    return date(month.year + (month.month == 12), month.month % 12 + 1, 1)


@functools.lru_cache(maxsize=64)
def _month_end_ms(month: date) -> int:
    """The first instant after ``month`` (cached: every window of a month asks)."""
    return month_start_ms(next_month(month))


def month_bounds_ms(month: date) -> tuple[int, int]:
    return month_start_ms(month), month_start_ms(next_month(month))


# Close a month this long after it ends: agents report windows within a minute
# or two (and retry from their spool), so the month's last windows are in.
CLOSE_SETTLE_MS = 60 * 60 * 1000


def month_to_close(*, now_ms: int) -> date | None:
    """The previous month, once it has been over for CLOSE_SETTLE_MS; None before that."""
    this_month = month_of(now_ms)
    if now_ms - month_start_ms(this_month) < CLOSE_SETTLE_MS:
        return None
    previous = month_of(month_start_ms(this_month) - 1)
    return previous


# --- rating a window ------------------------------------------------------


@dataclass(frozen=True)
class PricePoint:
    """A price in force from ``from_ms`` until the next point of the same schedule."""

    from_ms: int
    per_gpu_hour: Decimal
    price_id: int | None = None


@dataclass(frozen=True)
class DiscountSpan:
    from_ms: int
    until_ms: int | None
    percent: Decimal


@dataclass(frozen=True)
class Usage:
    start_ms: int
    end_ms: int
    gpu_milli: int
    sm_util_ms: int = 0
    memory_avg_mb: int = 0
    energy_mj: int = 0


@dataclass(frozen=True)
class Piece:
    start_ms: int
    end_ms: int
    month: date
    price_id: int | None
    rate_per_gpu_hour: Decimal
    gpu_ms: int
    sm_util_ms: int
    memory_mb_ms: int
    energy_mj: int
    amount: Decimal


def price_in_force(prices: list[PricePoint], at_ms: int) -> PricePoint | None:
    """``prices`` sorted by ``from_ms``: the last one that started at or before ``at_ms``."""
    i = bisect.bisect_right([p.from_ms for p in prices], at_ms)
    return prices[i - 1] if i else None


def discount_in_force(discounts: list[DiscountSpan], at_ms: int) -> Decimal:
    """The largest discount in force at ``at_ms`` (discounts do not stack)."""
    best = Decimal(0)
    for d in discounts:
        if d.from_ms <= at_ms and (d.until_ms is None or at_ms < d.until_ms):
            best = max(best, d.percent)
    return best


def _split(total: int, weights: list[int]) -> list[int]:
    """Split an integer in proportion to ``weights``, exactly (the last part takes the remainder)."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights[:-1]]
    return [*parts, total - sum(parts)]


@functools.lru_cache(maxsize=1024)
def _piece_rate(per_gpu_hour: Decimal, multiplier: Decimal, discount_pct: Decimal) -> Decimal:
    """The effective rate a piece carries, exact to 10 places.

    Cached: ingest rates thousands of windows at a handful of rates.
    """
    rate = effective_rate(per_gpu_hour=per_gpu_hour, multiplier=multiplier, discount_pct=discount_pct)
    return rate.quantize(EXACT, rounding=ROUND_HALF_EVEN)


def rate_usage(
    usage: Usage,
    *,
    prices: list[PricePoint],
    multiplier: Decimal = Decimal(1),
    discounts: list[DiscountSpan] = (),
) -> list[Piece]:
    """Rate one window: one piece per (price, discount, month) in force during it.

    The pieces cover the window exactly; their gpu_ms and metered figures add
    up exactly to the window's. Time before the first price is rated at 0
    with ``price_id`` None (logged by the caller).
    """
    if usage.end_ms <= usage.start_ms:
        raise ValueError("a window must end after it starts")
    cuts = {usage.start_ms, usage.end_ms}
    for p in prices:
        if usage.start_ms < p.from_ms < usage.end_ms:
            cuts.add(p.from_ms)
    for d in discounts:
        for edge in (d.from_ms, d.until_ms):
            if edge is not None and usage.start_ms < edge < usage.end_ms:
                cuts.add(edge)
    month = month_of(usage.start_ms)
    while (edge := _month_end_ms(month)) < usage.end_ms:
        cuts.add(edge)
        month = next_month(month)
    edges = sorted(cuts)
    spans = list(zip(edges, edges[1:], strict=False))
    durations = [end - start for start, end in spans]
    total_gpu_ms = allocated_gpu_ms(start_ms=usage.start_ms, end_ms=usage.end_ms, gpu_milli=usage.gpu_milli)
    gpu_ms = _split(total_gpu_ms, durations)
    sm = _split(usage.sm_util_ms, durations)
    energy = _split(usage.energy_mj, durations)
    pieces = []
    for (start, end), g, s, e in zip(spans, gpu_ms, sm, energy, strict=True):
        price = price_in_force(prices, start)
        if price is None:
            rate, price_id = Decimal(0), None
        else:
            rate = _piece_rate(price.per_gpu_hour, multiplier, discount_in_force(discounts, start))
            price_id = price.price_id
        pieces.append(
            Piece(
                start_ms=start,
                end_ms=end,
                month=month_of(start),
                price_id=price_id,
                rate_per_gpu_hour=rate,
                gpu_ms=g,
                sm_util_ms=s,
                memory_mb_ms=usage.memory_avg_mb * (end - start),
                energy_mj=e,
                amount=window_amount(gpu_ms=g, per_gpu_hour=rate),
            )
        )
    return pieces


def job_estimate_amount(*, gpu_milli: int, seconds: int, per_gpu_hour: Decimal, multiplier: Decimal) -> Decimal:
    """Upper-bound cost of holding ``gpu_milli`` for ``seconds``, rounded to cents."""
    gpu_ms = seconds * 1000 * gpu_milli // 1000
    return line_round(window_amount(gpu_ms=gpu_ms, per_gpu_hour=per_gpu_hour, multiplier=multiplier))
