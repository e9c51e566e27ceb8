"""Stripe, in one small module that returns plain dataclasses.

Every mutating call carries an idempotency key derived from our own ids, so
a retry (stripe-python retries network errors, 409 and 5xx itself, with
exponential backoff, re-sending the same key) can never create a second
customer, item, invoice or charge. Nothing outside this module imports
``stripe`` except the webhook's signature check (``event_verify`` below).

Amounts cross this boundary as integer cents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import stripe
from django.conf import settings

MAX_NETWORK_RETRIES = 4


@dataclass(frozen=True)
class StripeCustomer:
    id: str
    email: str


@dataclass(frozen=True)
class StripePaymentMethod:
    id: str
    brand: str
    last4: str


@dataclass(frozen=True)
class StripeInvoiceItem:
    id: str
    amount_cents: int


@dataclass(frozen=True)
class StripeInvoice:
    id: str
    status: str  # draft | open | paid | void | uncollectible
    amount_due_cents: int


@dataclass(frozen=True)
class PaymentResult:
    paid: bool
    invoice: StripeInvoice | None
    failure_message: str = ""


@dataclass(frozen=True)
class StripeEventData:
    id: str
    type: str
    object_id: str
    metadata: dict
    payload: dict
    amount_paid_cents: int | None = None  # invoice events: what Stripe says was paid
    currency: str = ""


class GatewayError(Exception):
    """Stripe refused a request (not a card decline) or could not be reached after retries.

    ``transient`` is True when trying later may succeed (network, rate limit, 5xx).
    """

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class SignatureError(Exception):
    pass


def _key(*parts) -> str:
    return "gpushare-" + "-".join(str(p) for p in parts)


class StripeGateway:
    def __init__(self, *, api_key: str, api_base: str, localstripe: bool = False):
        self.client = stripe.StripeClient(
            api_key, base_addresses={"api": api_base}, max_network_retries=MAX_NETWORK_RETRIES
        )
        # localstripe (tests, the offline demo) differs from Stripe in two ways
        # we must bend to: it has no finalize endpoint (it pays drafts), and it
        # makes no invoice for a customer without a subscription (so each
        # customer gets a $0 monthly one there).
        self.localstripe = localstripe

    def _call(self, fn, params: dict, *, key: str | None = None, **path):
        options = {"idempotency_key": key} if key else {}
        try:
            return fn(*path.values(), params=params, options=options)
        except stripe.CardError:
            raise
        except stripe.StripeError as exc:
            transient = isinstance(exc, stripe.APIConnectionError | stripe.RateLimitError) or (
                exc.http_status is not None and exc.http_status >= 500
            )
            raise GatewayError(f"stripe: {exc.user_message or exc}", transient=transient) from exc

    def customer_ensure(self, *, tenant_id: int, email: str, name: str, existing_id: str = "") -> StripeCustomer:
        if existing_id:
            found = self._call(self.client.v1.customers.retrieve, {}, id=existing_id)
            return StripeCustomer(id=found.id, email=found.email or "")
        created = self._call(
            self.client.v1.customers.create,
            {"email": email, "name": name, "metadata": {"gpushare_tenant_id": str(tenant_id)}},
            key=_key("customer", tenant_id),
        )
        if self.localstripe:
            plan = self._call(
                self.client.v1.plans.create,
                {
                    "id": f"gpushare-zero-{tenant_id}",
                    "amount": 0,
                    "currency": "usd",
                    "interval": "month",
                    "product": {"name": "gpushare metered usage"},
                },
            )
            self._call(self.client.v1.subscriptions.create, {"customer": created.id, "items": [{"plan": plan.id}]})
        return StripeCustomer(id=created.id, email=created.email or "")

    def payment_method_attach(self, *, customer_id: str, payment_method_id: str) -> StripePaymentMethod:
        """Attach a payment method (from Stripe.js, or a test one like ``pm_card_visa``) as the default."""
        try:
            pm = self._call(
                self.client.v1.payment_methods.attach,
                {"customer": customer_id},
                key=_key("pm-attach", customer_id, payment_method_id),
                id=payment_method_id,
            )
        except stripe.CardError as exc:
            raise GatewayError(f"card declined: {exc.user_message or exc}") from exc
        self._call(
            self.client.v1.customers.update,
            {"invoice_settings": {"default_payment_method": pm.id}},
            key=_key("pm-default", customer_id, pm.id),
            id=customer_id,
        )
        card = pm.to_dict().get("card") or {}
        return StripePaymentMethod(id=pm.id, brand=card.get("brand", ""), last4=card.get("last4", ""))

    @property
    def items_before_invoice(self) -> bool:
        """localstripe only puts pending items on an invoice when it is created; Stripe takes ``invoice=``."""
        return self.localstripe

    def invoice_item_create(
        self,
        *,
        customer_id: str,
        line_id: int,
        amount_cents: int,
        currency: str,
        description: str,
        stripe_invoice_id: str = "",
    ) -> StripeInvoiceItem:
        params = {
            "customer": customer_id,
            "amount": amount_cents,
            "currency": currency,
            "description": description,
            "metadata": {"gpushare_invoice_line_id": str(line_id)},
        }
        if stripe_invoice_id:
            params["invoice"] = stripe_invoice_id
        item = self._call(self.client.v1.invoice_items.create, params, key=_key("invoice-line", line_id))
        return StripeInvoiceItem(id=item.id, amount_cents=item.amount)

    def invoice_create(self, *, customer_id: str, invoice_id: int, description: str) -> StripeInvoice:
        """A draft invoice. With Stripe it starts empty (our items are added to it by id, so another
        month's stray pending items can never land on it); localstripe sweeps in the pending items."""
        params = {
            "customer": customer_id,
            "description": description,
            "pending_invoice_items_behavior": "include" if self.items_before_invoice else "exclude",
            "metadata": {"gpushare_invoice_id": str(invoice_id)},
        }
        if not self.localstripe:
            params["auto_advance"] = False  # we finalize and pay it ourselves
        invoice = self._call(self.client.v1.invoices.create, params, key=_key("invoice", invoice_id))
        return self._invoice(invoice)

    def invoice_finalize(self, *, stripe_invoice_id: str, invoice_id: int) -> StripeInvoice:
        if self.localstripe:
            return self._invoice(self._call(self.client.v1.invoices.retrieve, {}, id=stripe_invoice_id))
        invoice = self._call(
            self.client.v1.invoices.finalize_invoice,
            {"auto_advance": False},
            key=_key("invoice-finalize", invoice_id),
            id=stripe_invoice_id,
        )
        return self._invoice(invoice)

    def invoice_pay(self, *, stripe_invoice_id: str, invoice_id: int, attempt: int) -> PaymentResult:
        """Try to charge the invoice; a decline is a result, not an exception.

        ``attempt`` is part of the idempotency key: a retry of the same attempt
        replays it, a deliberate new attempt (after a failure) charges again.
        """
        try:
            invoice = self._call(
                self.client.v1.invoices.pay, {}, key=_key("invoice-pay", invoice_id, attempt), id=stripe_invoice_id
            )
        except stripe.CardError as exc:
            return PaymentResult(paid=False, invoice=None, failure_message=str(exc.user_message or exc)[:300])
        except GatewayError as exc:
            if "payment method" in str(exc).lower():
                return PaymentResult(paid=False, invoice=None, failure_message=str(exc)[:300])
            raise
        result = self._invoice(invoice)
        if result.status == "paid":
            return PaymentResult(paid=True, invoice=result)
        return PaymentResult(paid=False, invoice=result, failure_message="the payment was declined")

    @staticmethod
    def _invoice(invoice) -> StripeInvoice:
        return StripeInvoice(id=invoice.id, status=invoice.status, amount_due_cents=invoice.amount_due or 0)


def gateway() -> StripeGateway:
    return StripeGateway(
        api_key=settings.STRIPE_API_KEY,
        api_base=settings.STRIPE_API_BASE,
        localstripe=settings.STRIPE_LOCALSTRIPE,
    )


def event_verify(*, payload: bytes, signature: str, secret: str) -> StripeEventData:
    """Check ``Stripe-Signature`` and return the event; raise SignatureError if it does not verify."""
    try:
        stripe.WebhookSignature.verify_header(payload.decode("utf-8"), signature, secret, tolerance=300)
        event = json.loads(payload)
    except (stripe.SignatureVerificationError, ValueError, UnicodeDecodeError) as exc:
        raise SignatureError(str(exc)) from exc
    if not isinstance(event, dict) or not isinstance(event.get("id"), str) or not isinstance(event.get("type"), str):
        raise SignatureError("not a Stripe event")
    data = (event.get("data") or {}).get("object") or {}
    amount_paid = data.get("amount_paid")
    return StripeEventData(
        id=event["id"],
        type=event["type"],
        object_id=str(data.get("id") or ""),
        metadata=dict(data.get("metadata") or {}),
        payload=event,
        amount_paid_cents=amount_paid if isinstance(amount_paid, int) and not isinstance(amount_paid, bool) else None,
        currency=str(data.get("currency") or "").lower(),
    )
