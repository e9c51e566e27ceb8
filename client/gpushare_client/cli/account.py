"""Money and limits: usage, quota, estimate; and shell completion."""

from __future__ import annotations

from decimal import Decimal

import click
from click.shell_completion import get_completion_class

from .app import GPUS, dollars, emit, gpushare, out, output_options, state, table


def _hours(seconds) -> str:
    return f"{Decimal(str(seconds)) / 3600:.3f}"


@gpushare.command(short_help="GPU-hours and cost over a period.")
@click.option("--start", help="ISO 8601 date-time (default: the start of this month, UTC).")
@click.option("--end", help="ISO 8601 date-time, exclusive (default: now).")
@click.option("--group-by", type=click.Choice(["day", "job", "gpu_model"]), help="One row per day, job or model.")
@output_options
def usage(start, end, group_by) -> int:
    """GPU-hours and cost over a period."""
    found = state().client().usage(start=start, end=end, group_by=group_by)
    key = {"day": "day", "job": "job", "gpu_model": "gpu_model"}.get(group_by or "")
    rows = [
        (*([getattr(r, key)] if key else []), _hours(r.held_gpu_seconds), _hours(r.used_gpu_seconds), dollars(r.cost))
        for r in found.rows
    ]
    header = (*([key.upper().replace("_", " ")] if key else []), "GPU-HOURS HELD", "GPU-HOURS USED", "COST")
    first = 1 if key else 0
    lines = table(header, rows, right=tuple(range(first, first + 3)))
    lines.append(
        f"{dollars(found.cost)} in all" + (f" from {start}" if start else " this month") + (f" to {end}" if end else "")
    )
    emit(found.raw, lines)
    return 0


@gpushare.command(short_help="Limits, use, headroom and the month's budget.")
@output_options
def quota(**_) -> int:
    """Limits, what is held now, headroom, and the month's spend against the budget."""
    body = state().client().quota()
    limits, current, room, month = body["limits"], body["current"], body["headroom"], body["month"]

    def show(value) -> str:
        return "no limit" if value is None else str(value)

    rows = [
        ("dedicated GPUs", current["dedicated_gpus"], show(limits["max_dedicated_gpus"]), show(room["dedicated_gpus"])),
        ("shared GPUs", current["shared_gpus"], show(limits["max_shared_gpus"]), show(room["shared_gpus"])),
        ("open jobs", current["open_jobs"], show(limits["max_open_jobs"]), show(room["open_jobs"])),
    ]
    lines = table(("", "NOW", "LIMIT", "HEADROOM"), rows, right=(1, 2, 3))
    spend_limit = limits["monthly_spend_limit"]
    lines += [
        f"GPUs per job at most: {show(limits['max_gpus_per_job'])}",
        f"this month: {month['gpu_hours_used']} GPU-hours of {show(limits['gpu_hours_per_month'])}"
        + (f" ({month['gpu_hours_percent']}%)" if month.get("gpu_hours_percent") is not None else ""),
        f"            {dollars(month['spend'])} spent of {dollars(spend_limit) if spend_limit else 'no limit'}"
        + (f" ({month['spend_percent']}%)" if month.get("spend_percent") is not None else ""),
    ]
    if month.get("exhausted"):
        lines.append("the month's budget is used up: new jobs are refused")
    elif month.get("alert"):
        lines.append("spend has passed the month's alert threshold")
    emit(body, lines)
    return 0


def _hold(row: dict, body: dict):
    """What the job would hold against the budget at admission, where the platform says."""
    for source in (row, body):
        for key in ("hold", "budget_hold", "hold_amount", "money_hold"):
            if source.get(key) is not None:
                value = source[key]
                return value.get("amount", value.get("max")) if isinstance(value, dict) else value
    return None


@gpushare.command(short_help="What a job would cost (and hold).")
@click.option("--gpus", type=GPUS, default=1, show_default=True, help="1-8, or 0.125/0.25/0.5 of one GPU.")
@click.option("--kind", type=click.Choice(["training", "inference"]), help="Default: by --gpus.")
@click.option("--max-runtime-seconds", type=click.IntRange(1), default=3600, show_default=True)
@click.option("--priority", help="A priority class (default: by kind).")
@click.option("--gpu-model", help="Only this GPU model.")
@output_options
def estimate(gpus, kind, max_runtime_seconds, priority, gpu_model) -> int:
    """What a job would cost on each GPU model it may land on, and what it would hold."""
    body = (
        state()
        .client()
        .estimate(gpus=gpus, kind=kind, max_runtime_seconds=max_runtime_seconds, priority=priority, gpu_model=gpu_model)
    )
    results = body.get("results", [])
    holds = [_hold(r, body) for r in results]
    show_hold = any(h is not None for h in holds)
    rows = [
        (
            r["gpu_model"],
            r["mode"],
            r["priority"],
            dollars(r["price_per_gpu_hour"]),
            f"x{Decimal(str(r['multiplier'])).normalize()}",
            dollars(r["cost_per_hour"]),
            dollars(r["max_cost"]),
            *([dollars(hold)] if show_hold else []),
        )
        for r, hold in zip(results, holds, strict=True)
    ]
    header = ("GPU MODEL", "MODE", "PRIORITY", "PER GPU-HOUR", "CLASS", "PER HOUR", "AT MOST", "HOLD")
    header = header if show_hold else header[:-1]
    lines = table(header, rows, right=tuple(range(3, len(header))))
    hours = Decimal(max_runtime_seconds) / 3600
    lines.append(f"{gpus} GPU for at most {hours.normalize()} h (--max-runtime-seconds {max_runtime_seconds})")
    if show_hold:
        lines.append("HOLD: set aside from this month's budget while the job runs; the bill is what it uses")
    budget = body.get("hold") if isinstance(body.get("hold"), dict) else None
    if budget is not None:
        if budget.get("limit") is None:
            lines.append(f"submitting holds {dollars(budget['amount'])}; the tenant has no spend limit")
        else:
            lines.append(
                f"submitting holds {dollars(budget['amount'])}; {dollars(budget['left'])} of your "
                f"{dollars(budget['limit'])} budget is left ({dollars(budget['held'])} held by running and queued work)"
            )
            if not budget.get("fits", True):
                lines.append("this job does not fit: it would be refused (403 budget_exceeded)")
    if not results:
        lines = ["no GPU model can run this job (no price or no such GPU)"]
    emit(body, lines)
    return 0


@gpushare.command(short_help="Print the shell completion script.")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell) -> int:
    """Print the shell completion script: eval "$(gpushare completion bash)"."""
    ctx = click.get_current_context()
    complete = get_completion_class(shell)(ctx.find_root().command, {}, "gpushare", "_GPUSHARE_COMPLETE")
    out(complete.source())
    return 0
