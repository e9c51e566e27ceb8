"""Usage and billing: usage by day, job and GPU model; invoices; payment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.urls import reverse

from .. import selectors
from ..tenancy import tenant_page
from .common import page


def _month_from(raw: str) -> datetime:
    now = datetime.now(tz=UTC)
    try:
        year, month = (int(p) for p in raw.split("-", 1))
        return datetime(year, month, 1, tzinfo=UTC)
    except (TypeError, ValueError):
        return selectors.month_start(now)


def _invoice_links(invoice) -> dict:
    """The billing app's printable view (print to PDF) and per-job CSV."""
    return {
        "print": reverse("billing:invoice-detail", kwargs={"invoice_id": invoice.pk}),
        "csv": reverse("billing:invoice-csv", kwargs={"invoice_id": invoice.pk}),
    }


@tenant_page
def usage(request):
    tenant = request.portal.tenant
    start = _month_from(request.GET.get("month", ""))
    end = selectors.month_end(start)
    by_day = selectors.usage_by_day(tenant=tenant, start=start, end=end)
    by_model = selectors.usage_by_gpu_model(tenant=tenant, start=start, end=end)
    invoices = None
    if request.portal.can("billing.read"):
        invoices = [(inv, _invoice_links(inv)) for inv in selectors.invoices_for(tenant=tenant)]
    previous = (start - timedelta(days=1)).strftime("%Y-%m")
    following = end.strftime("%Y-%m") if end <= datetime.now(tz=UTC) else None
    return page(
        request,
        "portal/usage.html",
        {
            "month": start,
            "previous": previous,
            "following": following,
            "by_day": by_day,
            "by_job": selectors.usage_by_job(tenant=tenant, start=start, end=end),
            "by_model": by_model,
            "total": sum((row["amount"] for row in by_model), start=0),
            "total_gpu_ms": sum((row["gpu_ms"] for row in by_model), start=0),
            "chart": {
                "labels": [row["date"].isoformat() for row in by_day],
                "cost": [str(row["amount"]) for row in by_day],
                "gpu_hours": [round(row["gpu_ms"] / 3_600_000, 4) for row in by_day],
            },
            "spend": selectors.month_spend(tenant=tenant),
            "invoices": invoices,
        },
    )
