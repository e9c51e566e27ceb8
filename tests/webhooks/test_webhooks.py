"""Tenant webhooks: signed and timestamped deliveries a receiver can verify (and a replay it can
refuse), retries with backoff, re-sending, the SSRF guard (private addresses, DNS rebinding, the
address actually connected to, redirects), events from the services, and sends from the worker."""

from __future__ import annotations

import json
import re
import socket
import time
from datetime import date, timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from tests.api.helpers import job_make
from tests.factories import TenantFactory, member_add, wait_for
from webhooks import events, services, ssrf
from webhooks.models import Delivery, DeliveryAttempt, Webhook, WebhookEvent

from .receiver import Receiver

LOCAL = "127.0.0.1/32"


@pytest.fixture(autouse=True)
def _sends_stay_here(request, monkeypatch):
    """These tests send deliveries themselves: nothing goes to the session's Celery worker (which,
    when another test started it, would take them first). The worker test lets them through."""
    if "celery_worker_process" not in request.fixturenames:
        monkeypatch.setattr(services, "_send_soon", lambda ids: None)


@pytest.fixture
def receiver():
    found = Receiver()
    yield found
    found.close()


@pytest.fixture
def allow_local(settings):
    settings.GPUSHARE = {**settings.GPUSHARE, "WEBHOOK_ALLOWED_NETWORKS": LOCAL}


def hook(tenant, url: str, patterns=("job.*",)) -> Webhook:
    return services.webhook_create(tenant=tenant, user=None, url=url, event_types=list(patterns))


def deliveries(tenant) -> list[Delivery]:
    with scopes_disabled():
        return list(Delivery.objects.filter(tenant=tenant).select_related("event").order_by("pk"))


def due_now(delivery: Delivery) -> None:
    with scopes_disabled():
        Delivery.objects.filter(pk=delivery.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))


# --- signatures -------------------------------------------------------------------------------


def test_a_signature_verifies_and_a_replay_or_a_change_does_not():
    body = b'{"id":"evt_1"}'
    header = events.sign("whsec_a", body, timestamp=1_700_000_000)
    assert header.startswith("t=1700000000,v1=")
    assert events.verify("whsec_a", body, header, now=1_700_000_100) == 1_700_000_000
    for secret, payload, now, why in (
        ("whsec_b", body, 1_700_000_100, "does not match"),  # another secret
        ("whsec_a", body + b" ", 1_700_000_100, "does not match"),  # a changed body
        ("whsec_a", body, 1_700_000_000 + events.TOLERANCE_S + 1, "replay"),  # captured and sent again later
    ):
        with pytest.raises(events.SignatureError, match=why):
            events.verify(secret, payload, header, now=now)
    forged = header.replace("t=1700000000", "t=1700000900")  # a fresh timestamp on an old signature
    with pytest.raises(events.SignatureError, match="does not match"):
        events.verify("whsec_a", body, forged, now=1_700_000_900)
    # Two v1 values (a receiver that accepts the old and the new secret while rotating) are fine.
    both = header + ",v1=" + "0" * 64
    assert events.verify("whsec_a", body, both, now=1_700_000_100)


@pytest.mark.parametrize(
    ("ip", "problem"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("100.64.0.1", "not a public address"),  # carrier-grade NAT
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("93.184.216.34", None),
        ("2606:4700::1111", None),
    ],
)
def test_which_addresses_webhooks_may_reach(ip, problem):
    found = ssrf.address_problem(ip)
    assert (found is None) if problem is None else (problem in found), found
    assert ssrf.address_problem(ip, ssrf.networks_parse("0.0.0.0/0,::/0")) is None  # the operator may allow


# --- registering -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_registering_refuses_internal_addresses_unless_the_operator_allows(tenant, settings):
    for url in (
        "http://127.0.0.1:9/hook",
        "http://localhost/hook",
        "http://[::1]/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.5/hook",
    ):
        with pytest.raises(services.WebhookError, match="public addresses only"):
            hook(tenant, url)
    for url, why in (("ftp://example.com/x", "https://"), ("https://user:pw@example.com/", "credentials")):
        with pytest.raises(services.WebhookError, match=why):
            hook(tenant, url)
    with pytest.raises(services.WebhookError, match="matches no event"):
        hook(tenant, "http://93.184.216.34/", patterns=["jobs.*"])
    settings.GPUSHARE = {**settings.GPUSHARE, "WEBHOOK_ALLOWED_NETWORKS": LOCAL}
    assert hook(tenant, "http://127.0.0.1:9/hook").secret.startswith("whsec_")
    with pytest.raises(services.WebhookError):
        hook(tenant, "http://10.0.0.5/hook")  # only the networks allowed


# --- delivering --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_delivery_is_signed_timestamped_and_verifiable(rules, tenant, allow_local, receiver):
    webhook = hook(tenant, receiver.url)
    job = job_make(tenant, name="train")  # job.queued, emitted by job_submit
    [delivery] = deliveries(tenant)
    assert delivery.event.type == "job.queued" and delivery.state == Delivery.State.PENDING
    result = services.delivery_send(delivery_id=delivery.pk)
    assert result.sent and result.state == "succeeded" and result.status == 200
    [got] = receiver.got
    header = got["headers"][events.SIGNATURE_HEADER]
    assert abs(events.verify(webhook.secret, got["body"], header) - time.time()) < 30
    body = json.loads(got["body"])
    assert body["type"] == "job.queued" and body["id"] == f"evt_{delivery.event_id}" and body["tenant"] == "tenant-a"
    assert body["data"]["job"] == job.pk and body["data"]["name"] == "train" and body["data"]["state"] == "queued"
    assert got["headers"]["Gpushare-Event"] == "job.queued"
    assert got["headers"]["Gpushare-Delivery"] == str(delivery.pk)
    with scopes_disabled():
        attempt = DeliveryAttempt.objects.get(delivery=delivery)
    assert (attempt.status, attempt.address, attempt.error) == (200, "127.0.0.1", "")
    # Sending it again changes nothing: it is done (a task run twice).
    assert services.delivery_send(delivery_id=delivery.pk).sent is False and len(receiver.got) == 1


@pytest.mark.django_db(transaction=True)
def test_failures_are_retried_with_backoff_then_given_up_and_a_resend_repeats_the_event(rules, tenant, allow_local):
    receiver = Receiver([500, 503, 500, 500, 500, 500, 500, 500, 500])
    try:
        hook(tenant, receiver.url)
        job_make(tenant)
        [delivery] = deliveries(tenant)
        before = timezone.now()
        assert services.delivery_send(delivery_id=delivery.pk).state == "pending"
        with scopes_disabled():
            delivery.refresh_from_db()
        waited = (delivery.next_attempt_at - before).total_seconds()
        assert events.BACKOFF_S[0] * 0.85 <= waited <= events.BACKOFF_S[0] * 1.15
        assert delivery.last_status == 500 and "answered 500" in delivery.last_error
        assert services.delivery_send(delivery_id=delivery.pk).sent is False  # not due yet
        assert delivery.pk not in services.deliveries_due()
        delays = [waited]
        for _ in range(events.MAX_TRIES - 1):
            due_now(delivery)
            assert delivery.pk in services.deliveries_due()
            started = timezone.now()
            result = services.delivery_send(delivery_id=delivery.pk)
            with scopes_disabled():
                delivery.refresh_from_db()
            if delivery.next_attempt_at:
                delays.append((delivery.next_attempt_at - started).total_seconds())
        assert result.state == "failed" and delivery.state == Delivery.State.FAILED and delivery.next_attempt_at is None
        assert len(receiver.got) == events.MAX_TRIES
        assert delays == sorted(delays) and delays[-1] > 3 * 3600 * 0.85  # backing off, to hours
        first_body = receiver.got[0]["body"]

        services.delivery_resend(delivery=delivery, user=None)
        assert services.delivery_send(delivery_id=delivery.pk).state == "succeeded"  # the receiver is back
        assert receiver.got[-1]["body"] == first_body  # the same event, byte for byte: receivers dedupe by id
        with scopes_disabled():
            assert DeliveryAttempt.objects.filter(delivery=delivery).count() == events.MAX_TRIES + 1
    finally:
        receiver.close()


@pytest.mark.django_db(transaction=True)
def test_dns_rebinding_is_refused_at_delivery(rules, tenant, receiver, monkeypatch):
    real = socket.getaddrinfo
    answers = {"hooks.example.com": "93.184.216.34"}

    def resolver(host, port, *args, **kwargs):
        if host in answers:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(ssrf.socket, "getaddrinfo", resolver)
    hook(tenant, f"http://hooks.example.com:{receiver.port}/x")  # public when registered...
    answers["hooks.example.com"] = "127.0.0.1"  # ...loopback when delivered
    job_make(tenant)
    [delivery] = deliveries(tenant)
    result = services.delivery_send(delivery_id=delivery.pk)
    assert result.state == "pending" and "refused" in result.error and "loopback" in result.error
    assert receiver.got == []


@pytest.mark.django_db(transaction=True)
def test_the_address_actually_connected_to_is_checked(rules, tenant, allow_local, receiver, monkeypatch, settings):
    hook(tenant, receiver.url)
    settings.GPUSHARE = {**settings.GPUSHARE, "WEBHOOK_ALLOWED_NETWORKS": ""}
    # A resolver that lets loopback through (a bug, a race): the check after connect still refuses.
    monkeypatch.setattr(
        ssrf, "resolve", lambda host, port, allowed=(): [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (host, port))]
    )
    job_make(tenant)
    [delivery] = deliveries(tenant)
    result = services.delivery_send(delivery_id=delivery.pk)
    assert "connected to 127.0.0.1 is a loopback address" in result.error
    assert receiver.got == []


@pytest.mark.django_db(transaction=True)
def test_redirects_are_not_followed(rules, tenant, allow_local, receiver):
    bouncer = Receiver([302], location=receiver.url)
    try:
        hook(tenant, bouncer.url)
        job_make(tenant)
        [delivery] = deliveries(tenant)
        result = services.delivery_send(delivery_id=delivery.pk)
        assert result.status == 302 and "answered 302" in result.error
        assert receiver.got == []
    finally:
        bouncer.close()


# --- events from the services ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_job_events_follow_the_state_machine_and_roll_back_with_it(rules, tenant, other_tenant, allow_local):
    from scheduler.services import job_cancel

    mine = hook(tenant, "http://127.0.0.1:9/a", patterns=["job.cancelled"])
    everything = hook(tenant, "http://127.0.0.1:9/b", patterns=["*"])
    theirs = hook(other_tenant, "http://127.0.0.1:9/c", patterns=["*"])
    job = job_make(tenant)
    with scopes_disabled():
        job_cancel(job=job)
    types = sorted((d.webhook_id, d.event.type) for d in deliveries(tenant))
    assert types == sorted(
        [(everything.pk, "job.queued"), (everything.pk, "job.cancelled"), (mine.pk, "job.cancelled")]
    )
    assert deliveries(other_tenant) == [] and theirs.pk not in {d.webhook_id for d in deliveries(tenant)}

    # A change that rolls back reports nothing.
    with pytest.raises(RuntimeError), transaction.atomic():
        job_make(tenant)
        raise RuntimeError("rolled back")
    assert len(deliveries(tenant)) == 3


@pytest.mark.django_db(transaction=True)  # it closes the connection
def test_a_submit_reads_the_tenants_webhooks_in_its_insert_not_in_a_statement_of_its_own(
    rules, tenant, other_tenant, allow_local
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    connection.close()  # a new connection prepares every statement again: their text shows in the capture

    everything = hook(tenant, "http://127.0.0.1:9/all", patterns=["*"])
    hook(tenant, "http://127.0.0.1:9/cancels", patterns=["job.cancelled"])  # not this event
    off = hook(tenant, "http://127.0.0.1:9/off", patterns=["*"])
    with scopes_disabled():
        Webhook.objects.filter(pk=off.pk).update(active=False)
    hook(other_tenant, "http://127.0.0.1:9/theirs", patterns=["*"])
    member = member_add(tenant)  # before the capture: its own statements are not the submit's
    with CaptureQueriesContext(connection) as queries:
        job = job_make(tenant, user=member)
    assert [(d.webhook_id, d.event.type, d.event.data["job"]) for d in deliveries(tenant)] == [
        (everything.pk, "job.queued", job.pk)
    ]
    table = re.compile(rf"\b{Webhook._meta.db_table}\b")  # not webhooks_webhookevent
    reads = [q["sql"] for q in queries.captured_queries if table.search(q["sql"])]
    assert len(reads) == 1 and "INSERT INTO" in reads[0], reads  # only the insert's
    # A tenant with no webhook: no event, no delivery, and still no statement of its own.
    with CaptureQueriesContext(connection) as queries:
        job_make(TenantFactory(slug="quiet"))
    assert not [q for q in queries.captured_queries if "webhooks_webhookevent" in q["sql"]]


@pytest.mark.django_db(transaction=True)
def test_endpoint_budget_and_invoice_events(rules, tenant, allow_local, monkeypatch):
    from admission.services import budgets_enforce
    from endpoints.services import EndpointSpec, endpoint_autoscale, endpoint_create, endpoint_update

    hook(tenant, "http://127.0.0.1:9/all", patterns=["endpoint.*", "budget.*", "invoice.*"])
    owner = member_add(tenant)
    with scopes_disabled():
        endpoint = endpoint_create(
            tenant=tenant, user=owner, spec=EndpointSpec(name="llm", command=["x"], gpu_milli=250)
        )
        endpoint_update(endpoint=endpoint, user=owner, changes={"min_replicas": 1})
        endpoint_autoscale(endpoint_id=endpoint.pk)
    scaled = [d.event for d in deliveries(tenant) if d.event.type == "endpoint.scaled"]
    assert [(e.data["from"], e.data["to"], e.data["name"]) for e in scaled] == [(0, 1, "llm")]

    # Budget: over the alert threshold, and exhausted: each once a month, however often enforced.
    from accounts.limits import Refusal
    from accounts.selectors import limits_for
    from admission import selectors as admission_selectors
    from admission import services as admission_services

    monkeypatch.setattr(admission_services, "alert_due", lambda limits, usage: True)
    monkeypatch.setattr(
        admission_services, "budget_refusal", lambda limits, usage: Refusal("budget_exhausted", "used up; x")
    )
    monkeypatch.setattr(admission_selectors, "budgeted_tenants", lambda: {tenant.pk: limits_for(tenant)})
    budgets_enforce()
    budgets_enforce()
    kinds = [d.event.type for d in deliveries(tenant) if d.event.type.startswith("budget.")]
    assert sorted(kinds) == ["budget.exhausted", "budget.threshold"]

    from billing.models import Invoice
    from billing.services.invoices import invoice_transition

    with scopes_disabled(), transaction.atomic():
        invoice = Invoice.objects.create(tenant=tenant, month=date(2026, 3, 1), total="12.34")
        invoice_transition(invoice, Invoice.State.OPEN)
    [issued] = [d.event for d in deliveries(tenant) if d.event.type == "invoice.issued"]
    assert issued.data == {
        "invoice": invoice.pk,
        "month": "2026-03",
        "state": "open",
        "total": "12.34",
        "currency": "usd",
    }


@pytest.mark.django_db(transaction=True)
def test_the_web_request_only_queues_the_send(rules, tenant, api_client_for, allow_local, monkeypatch):
    hook(tenant, "http://127.0.0.1:9/x")

    def no_network_here(*args, **kwargs):
        raise AssertionError("a delivery was sent from the request")

    queued = []
    monkeypatch.setattr(ssrf, "post", no_network_here)
    monkeypatch.setattr(services, "_send_soon", lambda ids: queued.extend(ids))
    response = api_client_for(tenant).post(
        "/api/v1/jobs/", {"kind": "training", "gpus": 1, "command": ["x"]}, format="json"
    )
    assert response.status_code == 201
    assert queued == [d.pk for d in deliveries(tenant)] and len(queued) == 1


@pytest.mark.integration
def test_deliveries_go_out_from_the_worker(transactional_db, celery_worker_process, allow_local, receiver):
    """The session's worker runs with GPUSHARE_WEBHOOK_ALLOWED_NETWORKS=127.0.0.1/32 (tests/processes.py)."""
    tenant = TenantFactory(slug="hooked")
    hook(tenant, receiver.url)
    from tests.factories import platform_rules_seed

    platform_rules_seed()
    job = job_make(tenant)
    wait_for(lambda: receiver.got, timeout=30, what="the worker to deliver job.queued")
    assert json.loads(receiver.got[0]["body"])["data"]["job"] == job.pk
    [delivery] = deliveries(tenant)

    def recorded():
        with scopes_disabled():
            return Delivery.objects.filter(pk=delivery.pk, state="succeeded").exists()

    wait_for(recorded, timeout=10, what="the worker to record the delivery")

    # A send whose queueing was lost is picked up by the sweep (beat runs it every 5 s).
    from webhooks.tasks import deliveries_due_task

    with scopes_disabled():
        event = WebhookEvent.objects.create(tenant=tenant, type="ping", data={})
        lost = Delivery.objects.create(tenant=tenant, webhook=Webhook.objects.get(tenant=tenant), event=event)
        Delivery.objects.filter(pk=lost.pk).update(next_attempt_at=timezone.now())
    deliveries_due_task.delay()
    wait_for(lambda: len(receiver.got) == 2, timeout=30, what="the sweep to send the lost delivery")
    assert json.loads(receiver.got[1]["body"])["type"] == "ping"
