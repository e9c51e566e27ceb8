"""The printable invoice and its per-job CSV: portal pages like the rest, through ``tenant_page``.

The page runs inside the tenant's scope and reads through selectors that take the tenant, so
another tenant's invoice is a 404 exactly like a missing one. Billing is for the roles with
``billing.read`` (owners); for the others the invoice is a 404 too.
"""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import render

from billing import selectors as billing_selectors
from billing.views import invoice_csv_response

from ..tenancy import tenant_page


def _invoice(request, invoice_id: int):
    if not request.portal.can("billing.read"):
        raise Http404("no such invoice")
    invoice = billing_selectors.invoice_with_lines(tenant=request.portal.tenant, invoice_id=invoice_id)
    if invoice is None:
        raise Http404("no such invoice")
    return invoice


@tenant_page
def invoice_detail(request, invoice_id: int):
    invoice = _invoice(request, invoice_id)
    lines = billing_selectors.invoice_lines_display(invoice=invoice)
    return render(request, "billing/invoice_detail.html", {"invoice": invoice, "lines": lines})


@tenant_page
def invoice_csv(request, invoice_id: int):
    return invoice_csv_response(_invoice(request, invoice_id))
