"""Billing pages: the Stripe webhook and the operator's ledger report.

The printable invoice and its CSV are portal pages (portal/views/invoices.py, through the portal's
tenant decorator); ``invoice_csv_response`` writes the CSV for them and for the API, inside the
caller's tenant scope.
"""

from __future__ import annotations

import csv
import logging

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from django_scopes import scopes_disabled

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


def invoice_csv_response(invoice) -> HttpResponse:
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="invoice-{invoice.pk}-{invoice.month:%Y-%m}-jobs.csv"'
    writer = csv.writer(response)
    writer.writerow(selectors.INVOICE_CSV_COLUMNS)
    for row in selectors.invoice_job_rows(invoice=invoice):  # inside the caller's tenant scope
        writer.writerow(row)
    return response


def invoice_print_operator(request, invoice_id: int):
    """The printable invoice for the operator (the admin's "print" link, behind ``admin_view``: staff
    only); tenants use the portal's page."""
    with scopes_disabled():  # the operator reads every tenant's invoices
        invoice = selectors.invoice_with_lines_for_operator(invoice_id=invoice_id)
        if invoice is None:
            raise Http404("no such invoice")
        lines = selectors.invoice_lines_display(invoice=invoice)
        return render(request, "billing/invoice_detail.html", {"invoice": invoice, "lines": lines, "operator": True})


@staff_member_required
def ledger_report(request):
    """Operator report: per GPU model and node, utilisation, revenue and idle capacity for a month."""
    raw = request.GET.get("month") or f"{timezone.now():%Y-%m}"
    try:
        month = selectors.month_parse(raw)
    except ValueError as exc:
        return HttpResponseBadRequest(str(exc), content_type="text/plain")
    with scopes_disabled():  # the operator's report: every tenant's usage on every GPU
        report = selectors.ledger_month(month=month, until=timezone.now())
    return render(request, "billing/ledger.html", {"report": report, "month": month})
