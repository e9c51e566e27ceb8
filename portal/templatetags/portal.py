"""Formatting for portal pages: money, durations, GPU amounts, state badges."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from django import template
from django.utils.html import format_html

register = template.Library()


CENT = Decimal("0.01")


def money_text(value) -> str:
    """A page's figure: rounded half-up to the cent, "<$0.01" for a positive amount below half a cent."""
    if value in (None, ""):
        return "—"
    exact = Decimal(value)
    amount = exact.quantize(CENT, rounding=ROUND_HALF_UP)
    if amount == 0 and exact > 0:
        return "<$0.01"
    sign = "-" if amount < 0 else ""
    return f"{sign}${abs(amount):,}"


def money_exact(value) -> str:
    """The exact figure (the API's), without trailing zeros past the cent: $0.0123456789, $2.50."""
    exact = Decimal(value or 0)
    text = format(exact.normalize(), "f")
    if "." not in text or len(text.split(".")[1]) < 2:
        text = format(exact.quantize(CENT), "f")
    return f"-${text[1:]}" if text.startswith("-") else f"${text}"


@register.filter
def money(value, _places=None) -> str:
    """Money on a page (docs/billing.md, "Money on screen"): to the cent, the exact figure on hover.
    Invoices show what was billed instead (``billed``); the API gives exact figures."""
    if value in (None, ""):
        return "—"
    return format_html('<span class="money" title="{} exact">{}</span>', money_exact(value), money_text(value))


@register.filter
def billed(value) -> str:
    """An invoice's amount as billed (each line rounded once, half up, to the cent; the total their sum)."""
    if value in (None, ""):
        return "—"
    amount = Decimal(value).quantize(CENT, rounding=ROUND_HALF_UP)
    return f"{'-' if amount < 0 else ''}${abs(amount):,}"


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
