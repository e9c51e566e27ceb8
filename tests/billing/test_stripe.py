"""Stripe end to end on localstripe, the webhook, and real-Stripe calls against recorded responses."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import threading
import time
from datetime import date, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant
from billing.gateway import GatewayError, StripeGateway
from billing.models import BillingPolicy, Invoice, StripeEvent
from billing.services import usage_windows_ingest
from billing.services.invoices import invoice_close
from billing.services.payments import dunning_check, invoice_collect, invoice_send, payment_method_set
from tests.billing.conftest import ms, window
from tests.factories import wait_for

MARCH = date(2026, 3, 1)


@pytest.fixture(autouse=True)
def _platform_wide():
    """These tests read as the platform does (webhooks and dunning are not tenant requests)."""
    with scopes_disabled():
        yield


def signed(payload: bytes, secret: str, *, at: int | None = None) -> str:
    at = at or int(time.time())
    mac = hmac.new(secret.encode(), f"{at}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={at},v1={mac}"


def march_invoice(fleet, tenant, node_name="node-a") -> Invoice:
    node = fleet.nodes.get(node_name) or fleet.node(node_name)
    job = fleet.job(tenant, node=node, gpu_milli=1000, gpu_indexes=[0 if tenant.slug == "tenant-a" else 1])
    t = ms(2026, 3, 20, 9)
    usage_windows_ingest(node=node, windows=[window(job, s, t + s * 600_000, t + (s + 1) * 600_000) for s in range(12)])
    with scopes_disabled():
        return invoice_close(tenant=tenant, month=MARCH)


def state_of(invoice) -> Invoice:
    with scopes_disabled():
        return Invoice.objects.get(pk=invoice.pk)


@pytest.mark.django_db(transaction=True)
def test_paid_end_to_end_on_localstripe(localstripe, live_server, settings, fleet, tenant):
    call_command("localstripe_webhook", "--url", f"{live_server.url}/billing/stripe/webhook/", stdout=io.StringIO())
    Tenant.objects.filter(pk=tenant.pk).update(billing_email="ops@tenant-a.test")
    invoice = march_invoice(fleet, tenant)
    assert str(invoice.total) == "4.98"  # 2 GPU-h of H100 at 2.49

    out = io.StringIO()
    call_command("payment_method_set", "--tenant", tenant.slug, "--payment-method", "pm_card_visa", stdout=out)
    invoice_send(invoice_id=invoice.pk)
    invoice_send(invoice_id=invoice.pk)  # a second run changes nothing

    paid = state_of(invoice)
    assert "4242 is the default" in out.getvalue()
    assert paid.state == Invoice.State.PAID and paid.stripe_invoice_id.startswith("in_")
    tenant.refresh_from_db()
    assert tenant.stripe_customer_id.startswith("cus_")
    remote = requests.get(f"{localstripe}/v1/invoices/{paid.stripe_invoice_id}", auth=("sk_test_local", "")).json()
    assert remote["status"] == "paid" and remote["amount_due"] == 498
    ours = [line for line in remote["lines"]["data"] if line["amount"]]  # beside localstripe's $0 subscription
    assert [line["amount"] for line in ours] == [498]
    # Stripe's own webhook reaches the endpoint, verifies and is stored once.
    wait_for(
        lambda: StripeEvent.objects.filter(type="invoice.payment_succeeded").exists(),
        timeout=30,
        what="the invoice.payment_succeeded webhook",
    )


@pytest.mark.django_db(transaction=True)
def test_declined_card_fails_then_suspends_after_grace(localstripe, fleet, tenant):
    BillingPolicy.objects.create(payment_grace_days=7, suspend_after_failures=2)
    invoice = march_invoice(fleet, tenant)
    payment_method_set(tenant=tenant, payment_method_id="pm_card_chargeCustomerFail")

    invoice_send(invoice_id=invoice.pk)
    failed = state_of(invoice)
    assert failed.state == Invoice.State.PAYMENT_FAILED and failed.failure_count == 1

    invoice_collect(invoice_id=invoice.pk)  # the retry fails too, still inside the grace period
    tenant.refresh_from_db()
    assert state_of(invoice).failure_count == 2
    assert tenant.state == Tenant.State.ACTIVE
    assert dunning_check(at=timezone.now() + timedelta(days=6)) == []

    assert dunning_check(at=timezone.now() + timedelta(days=8)) == [invoice.pk]
    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.SUSPENDED


@pytest.mark.django_db
def test_webhook_rejects_bad_signatures_and_ignores_replays(settings, fleet, tenant):
    invoice = march_invoice(fleet, tenant)
    Invoice.objects.filter(pk=invoice.pk).update(state=Invoice.State.OPEN, stripe_invoice_id="in_123")
    event = {
        "id": "evt_1",
        "object": "event",
        "type": "invoice.payment_succeeded",
        "data": {
            "object": {
                "id": "in_123",
                "object": "invoice",
                "amount_paid": 498,
                "currency": "usd",
                "metadata": {"gpushare_invoice_id": str(invoice.pk)},
            }
        },
    }
    body = json.dumps(event).encode()
    client = Client()

    def post(sig):
        return client.post("/billing/stripe/webhook/", body, content_type="application/json", HTTP_STRIPE_SIGNATURE=sig)

    forged = post(signed(body, "whsec_wrong"))
    stale = post(signed(body, settings.STRIPE_WEBHOOK_SECRET, at=int(time.time()) - 3600))
    missing = client.post("/billing/stripe/webhook/", body, content_type="application/json")
    assert [forged.status_code, stale.status_code, missing.status_code] == [400, 400, 400]
    assert state_of(invoice).state == Invoice.State.OPEN
    assert not StripeEvent.objects.exists()

    first = post(signed(body, settings.STRIPE_WEBHOOK_SECRET))
    Invoice.objects.filter(pk=invoice.pk).update(state=Invoice.State.OPEN)  # so a replay *could* act again
    replay = post(signed(body, settings.STRIPE_WEBHOOK_SECRET))

    assert (first.status_code, first.content) == (200, b"ok")
    assert (replay.status_code, replay.content) == (200, b"replay ignored")
    assert StripeEvent.objects.filter(event_id="evt_1").count() == 1
    assert state_of(invoice).state == Invoice.State.OPEN  # the replay did not apply


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("event_type", "amount", "currency", "why"),
    [
        ("invoice.paid", 1, "usd", "amount paid 1 cents instead of 498"),
        ("invoice.paid", 498, "eur", "currency eur instead of usd"),
        ("invoice.payment_succeeded", 49800, "usd", "amount paid 49800 cents instead of 498"),
        ("invoice.paid", None, "usd", "amount paid (none) cents instead of 498"),
    ],
)
def test_a_paid_event_that_does_not_match_our_invoice_is_refused_loudly(
    settings, fleet, tenant, caplog, event_type, amount, currency, why
):
    from gpushare.observability.metrics import STRIPE_REFUSED

    invoice = march_invoice(fleet, tenant)
    Invoice.objects.filter(pk=invoice.pk).update(state=Invoice.State.OPEN, stripe_invoice_id="in_mm")
    data = {
        "id": "in_mm",
        "object": "invoice",
        "currency": currency,
        "metadata": {"gpushare_invoice_id": str(invoice.pk)},
    }
    if amount is not None:
        data["amount_paid"] = amount
    body = json.dumps(
        {"id": f"evt_mm_{event_type}_{amount}_{currency}", "type": event_type, "data": {"object": data}}
    ).encode()
    refused_before = STRIPE_REFUSED.labels("amount_mismatch")._value.get()

    response = Client().post(
        "/billing/stripe/webhook/",
        body,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=signed(body, settings.STRIPE_WEBHOOK_SECRET),
    )

    assert response.status_code == 400 and why in response.content.decode()
    assert state_of(invoice).state == Invoice.State.OPEN  # not marked paid
    assert not StripeEvent.objects.exists()  # not stored: Stripe's retry is refused again
    assert STRIPE_REFUSED.labels("amount_mismatch")._value.get() == refused_before + 1
    errors = [r for r in caplog.records if r.levelname == "ERROR" and "refused" in r.getMessage()]
    assert errors and why in errors[0].getMessage() and f"invoice {invoice.pk}" in errors[0].getMessage()


# --- real Stripe, recorded -------------------------------------------------------

RECORDED = {
    ("POST", "/v1/customers"): {"id": "cus_R1", "object": "customer", "email": "a@example.test"},
    ("POST", "/v1/invoiceitems"): {"id": "ii_R1", "object": "invoiceitem", "amount": 498},
    ("POST", "/v1/invoices"): {"id": "in_R1", "object": "invoice", "status": "draft", "amount_due": 498},
    ("POST", "/v1/invoices/in_R1/finalize"): {"id": "in_R1", "object": "invoice", "status": "open", "amount_due": 498},
    ("POST", "/v1/invoices/in_R1/pay"): {"id": "in_R1", "object": "invoice", "status": "paid", "amount_due": 498},
}


class RecordedStripe(BaseHTTPRequestHandler):
    """Replays responses recorded from api.stripe.com; the first /pay answers 500 once."""

    seen: list[tuple[str, str, str]] = []
    bodies: list[str] = []
    fail_pay_once = True

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        self.seen.append(("POST", self.path, self.headers.get("Idempotency-Key", "")))
        self.bodies.append(body)
        if self.path.endswith("/pay") and RecordedStripe.fail_pay_once:
            RecordedStripe.fail_pay_once = False
            return self._send(500, {"error": {"type": "api_error", "message": "try again"}})
        return self._send(200, RECORDED[("POST", self.path)])

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Request-Id", "req_recorded")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.django_db
def test_real_stripe_flow_finalizes_retries_5xx_with_the_same_key(fleet, tenant):
    invoice = march_invoice(fleet, tenant)
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordedStripe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    RecordedStripe.seen, RecordedStripe.bodies, RecordedStripe.fail_pay_once = [], [], True
    try:
        gw = StripeGateway(api_key="sk_test_x", api_base=f"http://127.0.0.1:{server.server_port}", localstripe=False)
        invoice_send(invoice_id=invoice.pk, gw=gw)
    finally:
        server.shutdown()

    paths = [p for _, p, _ in RecordedStripe.seen]
    assert paths == [
        "/v1/customers",
        "/v1/invoices",  # an empty draft first: items are added to it by id
        "/v1/invoiceitems",
        "/v1/invoices/in_R1/finalize",
        "/v1/invoices/in_R1/pay",
        "/v1/invoices/in_R1/pay",
    ]
    keys = [k for _, _, k in RecordedStripe.seen]
    assert all(k.startswith("gpushare-") for k in keys)
    assert "pending_invoice_items_behavior=exclude" in RecordedStripe.bodies[1]
    assert "invoice=in_R1" in RecordedStripe.bodies[2] and "amount=498" in RecordedStripe.bodies[2]
    assert keys[-1] == keys[-2] == f"gpushare-invoice-pay-{invoice.pk}-1"  # the retry replays, never a 2nd charge
    assert state_of(invoice).state == Invoice.State.PAID


class RefusingStripe(RecordedStripe):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        return self._send(400, {"error": {"type": "invalid_request_error", "message": "No such customer"}})


@pytest.mark.django_db
def test_a_refusal_is_a_permanent_gateway_error_and_the_invoice_stays_draft(fleet, tenant):
    invoice = march_invoice(fleet, tenant)
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusingStripe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gw = StripeGateway(api_key="sk_test_x", api_base=f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(GatewayError, match="No such customer") as raised:
            invoice_send(invoice_id=invoice.pk, gw=gw)
    finally:
        server.shutdown()
    assert raised.value.transient is False
    assert state_of(invoice).state == Invoice.State.DRAFT
