"""Read queries for the portal's webhook pages."""

from __future__ import annotations

from django.db.models import Count, Q, QuerySet

from .models import Delivery, Webhook


def webhooks_for_tenant(*, tenant) -> QuerySet[Webhook]:
    return Webhook.objects.filter(tenant=tenant).annotate(
        failing=Count("deliveries", filter=Q(deliveries__state=Delivery.State.FAILED)),
        pending=Count("deliveries", filter=Q(deliveries__state=Delivery.State.PENDING)),
    )


def deliveries_for_webhook(*, webhook: Webhook, limit: int = 50) -> list[Delivery]:
    return list(
        Delivery.objects.filter(webhook=webhook)
        .select_related("event")
        .prefetch_related("attempts")
        .order_by("-pk")[:limit]
    )
