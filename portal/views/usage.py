"""Usage and billing: usage by day, job and GPU model; invoices; payment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from billing.gateway import GatewayError
from billing.services.payments import payment_method_set

from .. import selectors
from ..tenancy import tenant_page
from .common import page

# Stripe's test payment methods, offered while the platform runs on a test key
# (real cards go through Stripe.js in production, which this page does not embed).
TEST_CARDS = [
    ("pm_card_visa", "Visa test card (succeeds)"),
    ("pm_card_mastercard", "Mastercard test card (succeeds)"),
    ("pm_card_chargeDeclined", "Test card that is declined"),
]


def _month_from(raw: str) -> datetime:
    now = datetime.now(tz=UTC)
    try:
        year, month = (int(p) for p in raw.split("-", 1))
        return datetime(year, month, 1, tzinfo=UTC)
    except (TypeError, ValueError):
        return selectors.month_start(now)


def _invoice_links(invoice) -> dict:
    """The printable invoice (print to PDF) and its per-job CSV (portal/views/invoices.py)."""
    return {
        "print": reverse("portal:invoice", kwargs={"invoice_id": invoice.pk}),
        "csv": reverse("portal:invoice_csv", kwargs={"invoice_id": invoice.pk}),
    }


@tenant_page
def usage(request):
    tenant = request.portal.tenant
    start = _month_from(request.GET.get("month", ""))
    end = selectors.month_end(start)
    by_day = selectors.usage_by_day(tenant=tenant, start=start, end=end)
    by_model = selectors.usage_by_gpu_model(tenant=tenant, start=start, end=end)
    invoices = None
    test_cards = (
        TEST_CARDS if request.portal.can("billing.manage") and settings.STRIPE_API_KEY.startswith("sk_test") else []
    )
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
                "models": [f"{row['gpu_model']} {row['mode']}" for row in by_model],
                "model_cost": [str(row["amount"]) for row in by_model],
            },
            "spend": selectors.month_spend(tenant=tenant),
            "invoices": invoices,
            "test_cards": test_cards,
        },
    )


@tenant_page(action="billing.manage")
@require_POST
def payment_method(request):
    """Make a Stripe test card the tenant's default payment method (test keys only)."""
    chosen = request.POST.get("payment_method", "")
    if chosen not in dict(TEST_CARDS) or not settings.STRIPE_API_KEY.startswith("sk_test"):
        messages.error(request, "Choose one of the listed test cards (only available with a Stripe test key).")
        return redirect("portal:usage")
    try:
        method = payment_method_set(tenant=request.portal.tenant, payment_method_id=chosen)
    except GatewayError as exc:
        messages.error(request, f"Stripe refused the card: {exc}")
    else:
        messages.success(request, f"{method.brand.title()} ending {method.last4} is now the default payment method.")
    return redirect("portal:usage")
