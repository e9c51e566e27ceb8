"""Tenant webhooks: URLs that get a signed POST when an event happens (docs/webhooks.md).

An event (``WebhookEvent``) is stored once, in the transaction of the change it
reports; each subscribed webhook gets a ``Delivery`` of it, retried with backoff
by the Celery workers, each try recorded as a ``DeliveryAttempt``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_scopes import ScopedManager

from accounts.models import Tenant


class Webhook(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=2000)
    # Event types or patterns ("job.*", "*"): see webhooks.events.EVENT_TYPES.
    events = models.JSONField(default=list)
    description = models.CharField(max_length=200, blank=True)
    # The HMAC key of the signature; shown to the tenant, who verifies with it.
    secret = models.CharField(max_length=80)
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["pk"]
        indexes = [models.Index(fields=["tenant", "active"], name="webhook_tenant_active")]

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.url}"


class WebhookEvent(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    type = models.CharField(max_length=64)
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)
    # An event that must happen once (budget.threshold of a month): a second emit with the key is ignored.
    dedupe_key = models.CharField(max_length=200, null=True, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "dedupe_key"], condition=Q(dedupe_key__isnull=False), name="webhookevent_dedupe"
            )
        ]


class Delivery(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"  # waiting for its next try
        SUCCEEDED = "succeeded"  # the receiver answered 2xx
        FAILED = "failed"  # every try of this round failed; can be re-sent

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    tries = models.PositiveIntegerField(default=0, help_text="Tries in this round (a re-send starts a new round).")
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    # A worker sending it holds it until then (another worker leaves it alone).
    leased_until = models.DateTimeField(null=True, blank=True)
    last_status = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-pk"]
        constraints = [models.UniqueConstraint(fields=["webhook", "event"], name="delivery_once_per_webhook")]
        indexes = [
            models.Index(fields=["next_attempt_at"], condition=Q(state="pending"), name="delivery_due"),
        ]


class DeliveryAttempt(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempts")
    at = models.DateTimeField(auto_now_add=True)
    duration_ms = models.PositiveIntegerField(default=0)
    status = models.PositiveIntegerField(null=True, blank=True, help_text="The receiver's HTTP status.")
    error = models.CharField(max_length=300, blank=True)
    address = models.CharField(max_length=64, blank=True, help_text="The IP address connected to.")
    response_excerpt = models.CharField(max_length=500, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-pk"]
