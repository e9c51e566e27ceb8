"""Billing pages: the Stripe webhook, the printable invoice and its per-job CSV."""

from __future__ import annotations

import csv
import logging

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from django_scopes import scopes_disabled

from accounts.permissions import role_allows, role_for

from . import gateway, selectors
from .services.payments import PaymentMismatch, stripe_event_apply

log = logging.getLogger(__name__)


@csrf_exempt
@require_POST
def stripe_webhook(request):
    """Stripe → us. Verify the signature, store the event id, ignore a replay, then apply."""
    try:
        event = gateway.event_verify(
            payload=request.body,
            signature=request.headers.get("Stripe-Signature", ""),
            secret=settings.STRIPE_WEBHOOK_SECRET,
        )
    except gateway.SignatureError as exc:
        log.warning("stripe webhook with a bad signature rejected: %s", exc)
        return HttpResponseBadRequest("invalid Stripe-Signature", content_type="text/plain")
    try:
        applied = stripe_event_apply(event=event)
    except PaymentMismatch as exc:
        return HttpResponseBadRequest(f"refused: {exc}", content_type="text/plain")
    return HttpResponse("ok" if applied else "replay ignored", content_type="text/plain")


def _invoice_for_user(user, invoice_id: int):
    """The invoice if ``user`` is staff or may read its tenant's billing; 404 otherwise (as if missing)."""
    with scopes_disabled():
        invoice = selectors.invoice_with_lines(invoice_id=invoice_id)
        if invoice is None:
            raise Http404("no such invoice")
        if not user.is_staff and not role_allows(role_for(user=user, tenant=invoice.tenant), "billing.read"):
            raise Http404("no such invoice")
        return invoice


@login_required
def invoice_detail(request, invoice_id: int):
    invoice = _invoice_for_user(request.user, invoice_id)
    with scopes_disabled():
        lines = selectors.invoice_lines_display(invoice=invoice)
    return render(request, "billing/invoice_detail.html", {"invoice": invoice, "lines": lines})


def invoice_csv_response(invoice) -> HttpResponse:
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="invoice-{invoice.pk}-{invoice.month:%Y-%m}-jobs.csv"'
    writer = csv.writer(response)
    writer.writerow(selectors.INVOICE_CSV_COLUMNS)
    with scopes_disabled():
        for row in selectors.invoice_job_rows(invoice=invoice):
            writer.writerow(row)
    return response


@login_required
def invoice_csv(request, invoice_id: int):
    return invoice_csv_response(_invoice_for_user(request.user, invoice_id))


@staff_member_required
def ledger_report(request):
    """Operator report: per GPU model and node, utilisation, revenue and idle capacity for a month."""
    raw = request.GET.get("month") or f"{timezone.now():%Y-%m}"
    try:
        month = selectors.month_parse(raw)
    except ValueError as exc:
        return HttpResponseBadRequest(str(exc), content_type="text/plain")
    with scopes_disabled():
        report = selectors.ledger_month(month=month, until=timezone.now())
    return render(request, "billing/ledger.html", {"report": report, "month": month})
