"""The only code that writes webhooks, events and deliveries.

``event_emit`` is what the rest of the platform calls (one line where a job
changes state, an endpoint scales, a budget threshold passes, an invoice is
issued): in the caller's transaction it stores the event and a delivery per
subscribed webhook, so an event is never reported for a change that rolled
back, nor lost for one that committed; after commit it queues the sends. The
sends happen in Celery workers (``delivery_send``), never in a web request.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.services import audit_record
from accounts.tenancy import acts_for_tenant
from gpushare.after_response import after_response
from gpushare.prepared import ServerStatement

from . import events, ssrf
from .models import Delivery, DeliveryAttempt, Webhook, WebhookEvent

log = logging.getLogger(__name__)

LEASE = timedelta(seconds=60)  # longer than one try can take (connect 5 s + read 10 s)
MAX_WEBHOOKS_PER_TENANT = 20


class WebhookError(ValueError):
    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = "invalid"


def allowed_networks() -> tuple:
    """The operator's exceptions to "public addresses only" (GPUSHARE_WEBHOOK_ALLOWED_NETWORKS)."""
    return ssrf.networks_parse(settings.GPUSHARE.get("WEBHOOK_ALLOWED_NETWORKS", ""))


def _url_check(url: str) -> str:
    url = (url or "").strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookError("the URL must start with https:// (or http://) and name a host", field="url")
    if parts.username or parts.password:
        raise WebhookError("put no credentials in the URL: verify the signature instead", field="url")
    if len(url) > 2000:
        raise WebhookError("the URL is longer than 2000 characters", field="url")
    try:
        ssrf.resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), allowed_networks())
    except ssrf.BlockedAddress as exc:
        # Checked again at every delivery (the DNS answer may change); refusing now says it early.
        raise WebhookError(f"webhooks reach public addresses only: {exc}", field="url") from exc
    return url


def _events_check(patterns) -> list[str]:
    problems = events.patterns_problems(patterns)
    if problems:
        raise WebhookError("; ".join(problems), field="events")
    return list(dict.fromkeys(patterns))


@acts_for_tenant
@transaction.atomic
def webhook_create(*, tenant, user, url: str, event_types: list[str], description: str = "") -> Webhook:
    if Webhook.objects.filter(tenant=tenant).count() >= MAX_WEBHOOKS_PER_TENANT:
        raise WebhookError(f"a tenant has at most {MAX_WEBHOOKS_PER_TENANT} webhooks")
    webhook = Webhook.objects.create(
        tenant=tenant,
        url=_url_check(url),
        events=_events_check(event_types),
        description=(description or "")[:200],
        secret=events.secret_new(),
        created_by=user if getattr(user, "pk", None) else None,
    )
    audit_record(
        actor=user, tenant=tenant, action="webhook.create", target=webhook.url, after={"events": webhook.events}
    )
    return webhook


@acts_for_tenant("webhook")
@transaction.atomic
def webhook_update(*, webhook: Webhook, user, url=None, event_types=None, description=None, active=None) -> Webhook:
    before = {"url": webhook.url, "events": webhook.events, "active": webhook.active}
    if url is not None:
        webhook.url = _url_check(url)
    if event_types is not None:
        webhook.events = _events_check(event_types)
    if description is not None:
        webhook.description = description[:200]
    if active is not None:
        webhook.active = bool(active)
    webhook.save()
    after = {"url": webhook.url, "events": webhook.events, "active": webhook.active}
    audit_record(
        actor=user, tenant=webhook.tenant, action="webhook.update", target=webhook.url, before=before, after=after
    )
    return webhook


@acts_for_tenant("webhook")
@transaction.atomic
def webhook_secret_rotate(*, webhook: Webhook, user) -> Webhook:
    webhook.secret = events.secret_new()
    webhook.save(update_fields=["secret", "updated_at"])
    audit_record(actor=user, tenant=webhook.tenant, action="webhook.secret_rotate", target=webhook.url)
    return webhook


@acts_for_tenant("webhook")
@transaction.atomic
def webhook_delete(*, webhook: Webhook, user) -> None:
    audit_record(actor=user, tenant=webhook.tenant, action="webhook.delete", target=webhook.url)
    webhook.delete()


# --- events --------------------------------------------------------------------------


def _send_soon(delivery_ids: list[int]) -> None:
    """Queue the sends (after commit: callers pass this to ``on_commit``) once the request's response is
    out (``gpushare.after_response``); the due-deliveries beat sends any that a lost kick leaves."""
    from .tasks import delivery_send_task

    def kick() -> None:
        for delivery_id in delivery_ids:
            delivery_send_task.delay(delivery_id=delivery_id)

    after_response(kick)


_ACTIVE_HOOKS = ServerStatement(
    f"SELECT id, events FROM {Webhook._meta.db_table} WHERE tenant_id = %s AND active ORDER BY id"
)


@acts_for_tenant("tenant_id")
def event_emit(
    *, tenant_id: int, type: str, data: dict, dedupe_key: str | None = None, active_hooks=None
) -> WebhookEvent | None:
    """Record ``type`` for the tenant's webhooks that subscribe to it, in the caller's transaction,
    and send after commit. One indexed query when none does, or none when the caller read the tenant's
    ``active_hooks`` (``(id, patterns)`` pairs: webhooks.emit.active_hooks_sql) in its transaction;
    ``dedupe_key``: at most once."""
    assert type in events.EVENT_TYPES, type
    if active_hooks is None:
        with connection.cursor() as cursor:  # written out: this runs inside every state change
            _ACTIVE_HOOKS.execute(cursor, [tenant_id])
            active_hooks = [(pk, json.loads(patterns)) for pk, patterns in cursor.fetchall()]
    hooks = [pk for pk, patterns in active_hooks if events.subscribed(patterns, type)]
    if not hooks:
        return None
    try:
        with transaction.atomic():
            event = WebhookEvent.objects.create(tenant_id=tenant_id, type=type, data=data, dedupe_key=dedupe_key)
    except IntegrityError:
        return None  # this once-only event was already emitted
    now = timezone.now()
    created = Delivery.objects.bulk_create(
        Delivery(tenant_id=tenant_id, webhook_id=pk, event=event, next_attempt_at=now) for pk in hooks
    )
    ids = [d.pk for d in created]
    transaction.on_commit(lambda: _send_soon(ids))
    return event


@acts_for_tenant("webhook")
@transaction.atomic
def webhook_ping(*, webhook: Webhook, user) -> Delivery:
    """A test delivery (event ``ping``) to this webhook only."""
    event = WebhookEvent.objects.create(
        tenant_id=webhook.tenant_id, type="ping", data={"webhook": webhook.pk, "by": getattr(user, "username", "")}
    )
    delivery = Delivery.objects.create(
        tenant_id=webhook.tenant_id, webhook=webhook, event=event, next_attempt_at=timezone.now()
    )
    transaction.on_commit(lambda: _send_soon([delivery.pk]))
    return delivery


@acts_for_tenant("delivery")
@transaction.atomic
def delivery_resend(*, delivery: Delivery, user) -> Delivery:
    """Send a delivery again (a new round of tries), whatever became of it."""
    delivery = Delivery.objects.select_for_update().get(pk=delivery.pk)
    delivery.state = Delivery.State.PENDING
    delivery.tries = 0
    delivery.next_attempt_at = timezone.now()
    delivery.leased_until = None
    delivery.save(update_fields=["state", "tries", "next_attempt_at", "leased_until"])
    audit_record(actor=user, tenant=delivery.tenant, action="webhook.resend", target=f"delivery {delivery.pk}")
    transaction.on_commit(lambda: _send_soon([delivery.pk]))
    return delivery


# --- sending ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendResult:
    sent: bool
    state: str = ""
    status: int | None = None
    error: str = ""


def _claim(delivery_id: int) -> Delivery | None:
    """Take the delivery for one try if it is due and no other worker holds it (a short transaction)."""
    now = timezone.now()
    with transaction.atomic():
        delivery = (
            Delivery.objects.select_for_update(skip_locked=True, of=("self",))  # not the tenant's row
            .select_related("webhook", "event", "tenant")
            .filter(pk=delivery_id, state=Delivery.State.PENDING)
            .first()
        )
        if delivery is None or (delivery.next_attempt_at and delivery.next_attempt_at > now):
            return None
        if delivery.leased_until and delivery.leased_until > now:
            return None
        delivery.leased_until = now + LEASE
        delivery.save(update_fields=["leased_until"])
    return delivery


def _headers(delivery: Delivery, body: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "gpushare-webhooks/1",
        events.SIGNATURE_HEADER: events.sign(delivery.webhook.secret, body),
        "Gpushare-Event": delivery.event.type,
        "Gpushare-Delivery": str(delivery.pk),
    }


@acts_for_tenant(("webhooks.Delivery", "delivery_id"))
def delivery_send(*, delivery_id: int) -> SendResult:
    """One try of a delivery (safe to run twice: a delivery not due, or held by another worker, is left).
    The HTTP request runs outside any transaction; its outcome is recorded in a short one."""
    delivery = _claim(delivery_id)
    if delivery is None:
        return SendResult(sent=False)
    event = delivery.event
    body = events.envelope(
        event_id=event.pk,
        event_type=event.type,
        created_ms=int(event.created_at.timestamp() * 1000),
        tenant=delivery.tenant.slug,
        data=event.data,
    )
    started = time.monotonic()
    status, error, address, excerpt = None, "", "", ""
    if not delivery.webhook.active:
        error = "the webhook is disabled"
    else:
        try:
            answer = ssrf.post(delivery.webhook.url, body, _headers(delivery, body), allowed=allowed_networks())
            status, address = answer.status, answer.address
            excerpt = answer.body[:500].decode("utf-8", "replace")
            if not 200 <= status < 300:
                error = f"the receiver answered {status}"
        except ssrf.BlockedAddress as exc:
            error = f"refused: {exc}"
        except Exception as exc:  # noqa: BLE001  (any network trouble is a failed try, recorded)
            error = f"{type(exc).__name__}: {exc}"[:300]
    duration_ms = int((time.monotonic() - started) * 1000)
    return _record(delivery, status=status, error=error[:300], address=address, excerpt=excerpt, ms=duration_ms)


@transaction.atomic
def _record(delivery: Delivery, *, status, error: str, address: str, excerpt: str, ms: int) -> SendResult:
    DeliveryAttempt.objects.create(
        tenant_id=delivery.tenant_id,
        delivery=delivery,
        duration_ms=ms,
        status=status,
        error=error,
        address=address,
        response_excerpt=excerpt,
    )
    now = timezone.now()
    delivery.tries += 1
    delivery.last_status, delivery.last_error, delivery.leased_until = status, error, None
    if not error:
        delivery.state, delivery.delivered_at, delivery.next_attempt_at = Delivery.State.SUCCEEDED, now, None
    else:
        delay = events.next_delay_s(delivery.tries)
        if delay is None:
            delivery.state, delivery.next_attempt_at = Delivery.State.FAILED, None
        else:
            delivery.next_attempt_at = now + timedelta(seconds=delay)
    delivery.save(
        update_fields=["tries", "last_status", "last_error", "leased_until", "state", "delivered_at", "next_attempt_at"]
    )
    if error:
        log.info("webhook delivery %s failed (try %s): %s", delivery.pk, delivery.tries, error)
    return SendResult(sent=True, state=delivery.state, status=status, error=error)


@scopes_disabled()  # the beat: every tenant's due deliveries
def deliveries_due(*, limit: int = 500) -> list[int]:
    """Pending deliveries whose next try is due and that no worker holds (the beat task sends them:
    retries, and sends whose after-commit enqueue was lost)."""
    now = timezone.now()
    return list(
        Delivery.objects.filter(state=Delivery.State.PENDING, next_attempt_at__lte=now)
        .exclude(leased_until__gt=now)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )
