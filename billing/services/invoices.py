"""Closing a month into invoices, and the invoice state machine."""

from __future__ import annotations

import logging
from datetime import date
from decimal import Decimal

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant

from .. import rating
from ..models import INVOICE_TRANSITIONS, Charge, Invoice, InvoiceLine

log = logging.getLogger(__name__)

LINE_KEY = ("gpu_model", "mode", "priority_class", "rate_per_gpu_hour")


class InvoiceError(ValueError):
    pass


def invoice_transition(invoice: Invoice, to_state: str, *, save_fields: tuple[str, ...] = ()) -> None:
    """Move ``invoice`` to ``to_state`` if the state machine allows it (the caller holds the row lock)."""
    if to_state not in INVOICE_TRANSITIONS[invoice.state]:
        raise InvoiceError(f"invoice {invoice.pk} cannot go from {invoice.state} to {to_state}")
    invoice.state = to_state
    invoice.save(update_fields=["state", *save_fields])


@scopes_disabled()
@transaction.atomic
def invoice_close(*, tenant: Tenant, month: date) -> Invoice | None:
    """Turn the tenant's uninvoiced charges up to ``month`` into that month's invoice.

    Idempotent: if the month already has an invoice it is returned unchanged
    (charges that arrive later go on the next month's invoice). A tenant with
    no charges gets no invoice. Lines: one per GPU model × mode × priority
    class × rate; each line's exact amount is rounded once, half up to cents,
    and the total is the sum of the rounded lines.
    """
    month = month.replace(day=1)
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()  # serialise concurrent closes
    existing = Invoice.objects.filter(tenant=tenant, month=month).first()
    if existing is not None:
        return existing
    pending = Charge.objects.filter(tenant=tenant, invoice__isnull=True, month__lte=month)
    groups = list(
        pending.values(*LINE_KEY)
        .annotate(
            gpu_ms_sum=Sum("gpu_ms"),
            sm=Sum("sm_util_ms"),
            mem=Sum("memory_mb_ms"),
            energy=Sum("energy_mj"),
            exact=Sum("amount"),
        )
        .order_by(*LINE_KEY)
    )
    if not groups:
        return None
    invoice = Invoice.objects.create(tenant=tenant, month=month, stripe_customer_id=tenant.stripe_customer_id)
    lines = [
        InvoiceLine(
            tenant=tenant,
            invoice=invoice,
            gpu_model=g["gpu_model"],
            mode=g["mode"],
            priority_class=g["priority_class"],
            rate_per_gpu_hour=g["rate_per_gpu_hour"],
            gpu_ms=g["gpu_ms_sum"],
            sm_util_ms=g["sm"],
            memory_mb_ms=g["mem"],
            energy_mj=g["energy"],
            exact_amount=g["exact"],
            amount=rating.line_round(g["exact"]),
        )
        for g in groups
    ]
    InvoiceLine.objects.bulk_create(lines)
    pending.update(invoice=invoice)
    invoice.total = sum((line.amount for line in lines), Decimal("0.00"))
    if invoice.total == 0:
        invoice.paid_at = timezone.now()
        invoice_transition(invoice, Invoice.State.PAID, save_fields=("total", "paid_at"))
    else:
        invoice.save(update_fields=["total"])
    log.info("invoice %s closed for %s %s: %s", invoice.pk, tenant.slug, f"{month:%Y-%m}", invoice.total)
    return invoice


@scopes_disabled()
def invoices_close_month(*, month: date) -> list[Invoice]:
    """Close ``month`` for every tenant with uninvoiced charges (one transaction per tenant)."""
    month = month.replace(day=1)
    tenant_ids = (
        Charge.objects.filter(invoice__isnull=True, month__lte=month).values_list("tenant_id", flat=True).distinct()
    )
    invoices = []
    for tenant in Tenant.objects.filter(pk__in=list(tenant_ids)).order_by("pk"):
        invoice = invoice_close(tenant=tenant, month=month)
        if invoice is not None:
            invoices.append(invoice)
    return invoices


@scopes_disabled()
@transaction.atomic
def invoice_void(*, invoice: Invoice, reason: str = "") -> Invoice:
    """Void an unpaid invoice; its charges go back to uninvoiced (the next close picks them up)."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    invoice.failure_message = reason[:300]
    invoice_transition(invoice, Invoice.State.VOID, save_fields=("failure_message",))
    Charge.objects.filter(invoice=invoice).update(invoice=None)
    return invoice
