"""Collecting invoices through Stripe, and applying Stripe's webhook events.

Sending an invoice talks to Stripe between short transactions: each step
stores the Stripe id it got, and every Stripe call carries an idempotency key
derived from our ids, so running ``invoice_send`` again after a crash resumes
where it stopped and never charges twice.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts import services as accounts_services
from accounts.models import Tenant
from accounts.tenancy import acts_for_tenant

from .. import gateway as stripe_gateway
from ..models import BillingPolicy, Invoice, InvoiceLine, StripeEvent
from .invoices import invoice_transition

log = logging.getLogger(__name__)

SUSPEND_REASON = "invoice {invoice} unpaid: {failures} failed payment(s), grace period over"


def billing_policy() -> BillingPolicy:
    policy = BillingPolicy.objects.order_by("pk").first()
    return policy or BillingPolicy.objects.create()


@transaction.atomic
def customer_ensure(*, tenant: Tenant, gw: stripe_gateway.StripeGateway | None = None) -> str:
    """The tenant's Stripe customer id (created once, keyed by the tenant id)."""
    gw = gw or stripe_gateway.gateway()
    tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
    if tenant.stripe_customer_id:
        return tenant.stripe_customer_id
    customer = gw.customer_ensure(tenant_id=tenant.pk, email=tenant.billing_email, name=tenant.name)
    Tenant.objects.filter(pk=tenant.pk).update(stripe_customer_id=customer.id)
    return customer.id


def payment_method_set(
    *, tenant: Tenant, payment_method_id: str, gw: stripe_gateway.StripeGateway | None = None
) -> stripe_gateway.StripePaymentMethod:
    """Make ``payment_method_id`` (from Stripe.js in the portal, or a test card) the tenant's default."""
    gw = gw or stripe_gateway.gateway()
    customer_id = customer_ensure(tenant=tenant, gw=gw)
    return gw.payment_method_attach(customer_id=customer_id, payment_method_id=payment_method_id)


def _line_description(line: InvoiceLine, month) -> str:
    hours = line.gpu_ms / 3_600_000
    return (
        f"{month:%Y-%m} {line.gpu_model} {line.mode} ({line.priority_class}): "
        f"{hours:.4f} GPU-h at {line.rate_per_gpu_hour.normalize()}/GPU-h"
    )


def _items_push(invoice: Invoice, *, customer_id: str, gw, stripe_invoice_id: str) -> None:
    for line in invoice.lines.filter(stripe_item_id="", amount__gt=0).order_by("pk"):
        item = gw.invoice_item_create(
            customer_id=customer_id,
            line_id=line.pk,
            amount_cents=int(line.amount * 100),
            currency=invoice.currency,
            description=_line_description(line, invoice.month),
            stripe_invoice_id=stripe_invoice_id,
        )
        InvoiceLine.objects.filter(pk=line.pk).update(stripe_item_id=item.id)


def _invoice_push(invoice: Invoice, *, customer_id: str, gw) -> None:
    if invoice.stripe_invoice_id:
        return
    created = gw.invoice_create(
        customer_id=customer_id, invoice_id=invoice.pk, description=f"gpushare GPU usage {invoice.month:%Y-%m}"
    )
    Invoice.objects.filter(pk=invoice.pk).update(stripe_invoice_id=created.id, stripe_customer_id=customer_id)
    invoice.stripe_invoice_id = created.id


@acts_for_tenant(("billing.Invoice", "invoice_id"))
def invoice_send(*, invoice_id: int, gw: stripe_gateway.StripeGateway | None = None) -> Invoice:
    """Push a draft invoice to Stripe (customer, items, invoice, finalize) and try to collect it."""
    gw = gw or stripe_gateway.gateway()
    invoice = Invoice.objects.select_related("tenant").get(pk=invoice_id)
    if invoice.state != Invoice.State.DRAFT:
        return invoice
    customer_id = customer_ensure(tenant=invoice.tenant, gw=gw)
    if gw.items_before_invoice:
        _items_push(invoice, customer_id=customer_id, gw=gw, stripe_invoice_id="")
        _invoice_push(invoice, customer_id=customer_id, gw=gw)
    else:
        _invoice_push(invoice, customer_id=customer_id, gw=gw)
        _items_push(invoice, customer_id=customer_id, gw=gw, stripe_invoice_id=invoice.stripe_invoice_id)
    finalized = gw.invoice_finalize(stripe_invoice_id=invoice.stripe_invoice_id, invoice_id=invoice.pk)
    if finalized.amount_due_cents != int(invoice.total * 100):
        log.error("stripe invoice %s is due %s cents, ours %s", finalized.id, finalized.amount_due_cents, invoice.total)
    with transaction.atomic():
        invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if invoice.state == Invoice.State.DRAFT:
            invoice.sent_at = timezone.now()
            invoice_transition(invoice, Invoice.State.OPEN, save_fields=("sent_at",))
    return invoice_collect(invoice_id=invoice.pk, gw=gw)


@acts_for_tenant(("billing.Invoice", "invoice_id"))
def invoice_collect(*, invoice_id: int, gw: stripe_gateway.StripeGateway | None = None) -> Invoice:
    """Charge an open (or failed) invoice's default payment method once more."""
    gw = gw or stripe_gateway.gateway()
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.state not in (Invoice.State.OPEN, Invoice.State.PAYMENT_FAILED):
        return invoice
    result = gw.invoice_pay(
        stripe_invoice_id=invoice.stripe_invoice_id, invoice_id=invoice.pk, attempt=invoice.failure_count + 1
    )
    if result.paid:
        return invoice_paid(invoice=invoice)
    return invoice_payment_failed(invoice=invoice, message=result.failure_message)


@acts_for_tenant("invoice")
@transaction.atomic
def invoice_paid(*, invoice: Invoice, at: datetime | None = None) -> Invoice:
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.state == Invoice.State.PAID:
        return invoice
    invoice.paid_at = at or timezone.now()
    invoice_transition(invoice, Invoice.State.PAID, save_fields=("paid_at",))
    return invoice


@acts_for_tenant("invoice")
@transaction.atomic
def invoice_payment_failed(*, invoice: Invoice, message: str = "", at: datetime | None = None) -> Invoice:
    """Record a failed payment; suspend the tenant once the grace period and failure count allow."""
    at = at or timezone.now()
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.state in (Invoice.State.PAID, Invoice.State.VOID):
        return invoice
    invoice.failure_count += 1
    invoice.first_failed_at = invoice.first_failed_at or at
    invoice.failure_message = (message or "payment failed")[:300]
    invoice_transition(
        invoice, Invoice.State.PAYMENT_FAILED, save_fields=("failure_count", "first_failed_at", "failure_message")
    )
    _suspend_if_due(invoice, at=at, policy=billing_policy())
    return invoice


def _suspend_if_due(invoice: Invoice, *, at: datetime, policy: BillingPolicy) -> bool:
    if invoice.state != Invoice.State.PAYMENT_FAILED or invoice.first_failed_at is None:
        return False
    if invoice.failure_count < policy.suspend_after_failures:
        return False
    if at - invoice.first_failed_at < timedelta(days=policy.payment_grace_days):
        return False
    tenant = Tenant.objects.select_for_update().get(pk=invoice.tenant_id)
    if tenant.state == Tenant.State.SUSPENDED:
        return False
    reason = SUSPEND_REASON.format(invoice=invoice.pk, failures=invoice.failure_count)
    accounts_services.tenant_suspend(tenant=tenant, actor=None, reason=reason)
    log.warning("tenant %s suspended: %s", tenant.slug, reason)
    return True


@scopes_disabled()  # the beat: every tenant's failed invoices
def dunning_check(*, at: datetime | None = None) -> list[int]:
    """Suspend tenants whose failed invoices have run out of grace (beat, hourly); returns invoice ids."""
    at = at or timezone.now()
    policy = billing_policy()
    suspended = []
    for invoice_id in Invoice.objects.filter(state=Invoice.State.PAYMENT_FAILED).values_list("pk", flat=True):
        with transaction.atomic():
            invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
            if _suspend_if_due(invoice, at=at, policy=policy):
                suspended.append(invoice_id)
    return suspended


# --- webhook ----------------------------------------------------------------


class PaymentMismatch(Exception):
    """A Stripe payment event that does not match our invoice: refused, never applied."""


def _payment_matches(invoice: Invoice, event: stripe_gateway.StripeEventData) -> str:
    """Why the paid amount or currency differ from our invoice ("" when they match)."""
    ours = int(invoice.total * 100)
    if event.currency != invoice.currency.lower():
        return f"currency {event.currency or '(none)'} instead of {invoice.currency.lower()}"
    if event.amount_paid_cents != ours:
        shown = "(none)" if event.amount_paid_cents is None else event.amount_paid_cents
        return f"amount paid {shown} cents instead of {ours}"
    return ""


@scopes_disabled()  # Stripe's event: the invoice it names is found before its tenant is known
@transaction.atomic
def stripe_event_apply(*, event: stripe_gateway.StripeEventData) -> bool:
    """Store a verified event and apply it; a replay (same event id) does nothing and returns False.

    A payment event (``invoice.paid``, ``invoice.payment_succeeded``) whose amount or
    currency is not our invoice's raises ``PaymentMismatch`` before anything is stored:
    the invoice stays unpaid, the error is logged and counted
    (``gpushare_stripe_webhook_refused_total{reason="amount_mismatch"}``), and Stripe,
    answered 400, shows the failed delivery and retries it (refused again each time).
    """
    if event.type in ("invoice.paid", "invoice.payment_succeeded"):
        invoice = _invoice_for_event(event)
        problem = _payment_matches(invoice, event) if invoice is not None else ""
        if problem:
            from gpushare.observability.metrics import STRIPE_REFUSED

            STRIPE_REFUSED.labels("amount_mismatch").inc()
            log.error(
                "stripe %s %s for invoice %s (tenant %s) refused: %s; the invoice stays %s",
                event.type,
                event.id,
                invoice.pk,
                invoice.tenant_id,
                problem,
                invoice.state,
            )
            raise PaymentMismatch(f"invoice {invoice.pk}: {problem}")
    _, created = StripeEvent.objects.get_or_create(
        event_id=event.id, defaults={"type": event.type, "payload": event.payload}
    )
    if not created:
        return False
    if event.type.startswith("invoice."):
        invoice = _invoice_for_event(event)
        if invoice is None:
            log.info("stripe %s for unknown invoice %s ignored", event.type, event.object_id)
        elif event.type in ("invoice.paid", "invoice.payment_succeeded"):
            invoice_paid(invoice=invoice)
        elif event.type == "invoice.payment_failed" and invoice.state == Invoice.State.OPEN:
            # A failure we caused by paying is already counted; this covers
            # failures Stripe reports on its own (e.g. an asynchronous decline).
            invoice_payment_failed(invoice=invoice, message="Stripe reported the payment failed")
    return True


def _invoice_for_event(event: stripe_gateway.StripeEventData) -> Invoice | None:
    ours = event.metadata.get("gpushare_invoice_id", "")
    if ours.isdigit():
        found = Invoice.objects.filter(pk=int(ours), stripe_invoice_id__in=("", event.object_id)).first()
        if found:
            return found
    return Invoice.objects.filter(stripe_invoice_id=event.object_id).exclude(stripe_invoice_id="").first()
