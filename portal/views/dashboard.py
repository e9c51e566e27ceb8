"""The dashboard: live jobs, GPUs held, spend against budget, quotas, failures, alerts."""

from __future__ import annotations

from collections import Counter

from admission import selectors as quotas

from .. import selectors
from ..templatetags.portal import counted
from ..tenancy import tenant_page
from .common import page


def _alerts(*, spend: selectors.Spend, failures: list, live: list) -> list[dict]:
    alerts = []
    if spend.exhausted:
        alerts.append({"level": "danger", "text": "This month's budget is used up: new jobs are refused."})
    elif spend.alert:
        alerts.append({"level": "warn", "text": "Spend has passed this month's alert threshold."})
    elif spend.budget and spend.projected >= spend.budget:
        alerts.append({"level": "warn", "text": "At this pace, spend will reach the budget before the month ends."})
    if failures:
        were = "was" if len(failures) == 1 else "were"
        text = f"{counted(len(failures), 'job')} failed or {were} lost in the last 7 days."
        alerts.append({"level": "warn", "text": text})
    waiting = [j for j in live if j.state == "queued" and j.pending_reason]
    if waiting:
        alerts.append({"level": "info", "text": waiting_text(waiting)})
    return alerts


def waiting_text(waiting: list) -> str:
    """ "1 job waiting: no node has 8 GPUs." Each reason with the number of jobs it holds back,
    the most common first (the jobs of one banner rarely wait for the same reason)."""
    reasons = Counter(j.pending_reason.rstrip(".") for j in waiting)
    if len(reasons) == 1:
        return f"{counted(len(waiting), 'job')} waiting: {next(iter(reasons))}."
    shown = [f"{counted(n, 'job')}: {reason}" for reason, n in reasons.most_common(3)]
    more = len(reasons) - len(shown)
    rest = f"; and {counted(more, 'other reason')}" if more else ""
    return f"{counted(len(waiting), 'job')} waiting ({'; '.join(shown)}{rest})."


@tenant_page
def dashboard(request):
    tenant = request.portal.tenant
    live = selectors.live_jobs(tenant=tenant)
    held = selectors.gpus_held(tenant=tenant)
    status = quotas.budget_status(tenant)
    spend = selectors.month_spend(tenant=tenant, status=status)
    failures = selectors.recent_failures(tenant=tenant)
    return page(
        request,
        "portal/dashboard.html",
        {
            "live": live,
            "held": held,
            "held_gpus": sum(h.gpu_milli for h in held),
            "spend": spend,
            "quotas": selectors.quota_bars(tenant=tenant, held=held, status=status),
            "limit_notes": selectors.limit_notes(status=status),
            "failures": failures,
            "alerts": _alerts(spend=spend, failures=failures, live=live),
            "counts": selectors.state_counts(tenant=tenant),
        },
    )


@tenant_page
def dashboard_live(request):
    """The live jobs table body, polled by the dashboard."""
    return page(request, "portal/partials/live_jobs.html", {"live": selectors.live_jobs(tenant=request.portal.tenant)})
