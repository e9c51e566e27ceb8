"""Formatting for portal pages: money, durations, GPU amounts, state badges."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from django import template

register = template.Library()


@register.filter
def money(value, places: int | None = None) -> str:
    """$1,234.57 (rounded half-up for display; invoices round per line).
    Without ``places``: cents, or 4 places for amounts under a dollar."""
    if value in (None, ""):
        return "—"
    if places is None:
        places = 4 if 0 < abs(Decimal(value)) < 1 else 2
    amount = Decimal(value).quantize(Decimal(1).scaleb(-int(places)), rounding=ROUND_HALF_UP)
    sign = "-" if amount < 0 else ""
    return f"{sign}${abs(amount):,}"


def counted(n: int, word: str, words: str | None = None) -> str:
    """ "1 job", "2 jobs": the plural rule for the portal's sentences."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


@register.filter
def plain(value) -> str:
    """A number without trailing zeros or exponent: Decimal('10.000') -> '10', 0.250 -> '0.25'."""
    if value in (None, ""):
        return "—"
    return format(Decimal(value).normalize(), "f")


@register.filter
def duration_ms(value) -> str:
    """1h 02m, 3m 05s, 12.3s."""
    if value in (None, ""):
        return "—"
    ms = int(value)
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


@register.filter
def duration_s(value) -> str:
    return "—" if value in (None, "") else duration_ms(int(value) * 1000)


@register.filter
def gpu_hours(gpu_ms) -> str:
    return f"{Decimal(int(gpu_ms or 0)) / 3_600_000:.3f}"


@register.filter
def gpus(milli) -> str:
    """2000 -> '2 GPUs', 250 -> '¼ GPU'."""
    milli = int(milli)
    if milli % 1000 == 0:
        n = milli // 1000
        return f"{n} GPU" if n == 1 else f"{n} GPUs"
    return {125: "⅛ GPU", 250: "¼ GPU", 500: "½ GPU"}.get(milli, f"{milli / 1000:g} GPU")


@register.filter
def percent(value, total) -> int:
    try:
        return max(0, min(100, round(Decimal(value) / Decimal(total) * 100)))
    except (ArithmeticError, TypeError, ValueError):
        return 0


@register.inclusion_tag("portal/partials/state.html")
def state_badge(state: str):
    return {"state": state}
