"""Webhooks: register URLs for events, see each delivery with its attempts, re-send, ping."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from webhooks import selectors as webhook_selectors
from webhooks import services as webhook_services
from webhooks.events import EVENT_TYPES, TOLERANCE_S
from webhooks.models import Delivery, Webhook

from ..tenancy import tenant_page
from ..webhook_forms import WebhookForm
from .common import page


def _webhook(request, pk: int) -> Webhook:
    # The tenant scope makes another tenant's webhook a 404, like a missing one.
    return get_object_or_404(Webhook.objects.filter(tenant=request.portal.tenant), pk=pk)


def _list(request, form: WebhookForm | None = None, *, status: int = 200):
    hooks = list(webhook_selectors.webhooks_for_tenant(tenant=request.portal.tenant))
    context = {"webhooks": hooks, "form": form or WebhookForm(), "event_types": EVENT_TYPES}
    return page(request, "portal/webhooks.html", context, status=status)


@tenant_page(action="webhooks.manage")
def webhook_list(request):
    if request.method == "POST":
        form = WebhookForm(request.POST)
        if form.is_valid():
            try:
                webhook = webhook_services.webhook_create(
                    tenant=request.portal.tenant,
                    user=request.user,
                    url=form.cleaned_data["url"],
                    event_types=form.cleaned_data["events"],
                    description=form.cleaned_data["description"],
                )
            except webhook_services.WebhookError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, str(exc))
            else:
                messages.success(request, "Webhook added. Its signing secret is on its page.")
                return redirect("portal:webhook", pk=webhook.pk)
        return _list(request, form, status=400)
    return _list(request)


@tenant_page(action="webhooks.manage")
def webhook_detail(request, pk: int):
    webhook = _webhook(request, pk)
    deliveries = webhook_selectors.deliveries_for_webhook(webhook=webhook)
    context = {"webhook": webhook, "deliveries": deliveries, "tolerance_s": TOLERANCE_S}
    response = page(request, "portal/webhook_detail.html", context)
    response["Cache-Control"] = "no-store"  # the page shows the signing secret
    return response


@tenant_page(action="webhooks.manage")
@require_POST
def webhook_action(request, pk: int, action: str):
    webhook = _webhook(request, pk)
    user = request.user
    if action == "ping":
        webhook_services.webhook_ping(webhook=webhook, user=user)
        messages.success(request, "Test delivery (ping) queued.")
    elif action == "rotate":
        webhook_services.webhook_secret_rotate(webhook=webhook, user=user)
        messages.success(request, "New signing secret: update your receiver.")
    elif action in ("enable", "disable"):
        webhook_services.webhook_update(webhook=webhook, user=user, active=action == "enable")
        messages.success(request, f"Webhook {action}d.")
    elif action == "delete":
        webhook_services.webhook_delete(webhook=webhook, user=user)
        messages.success(request, "Webhook deleted.")
        return redirect("portal:webhooks")
    return redirect("portal:webhook", pk=webhook.pk)


@tenant_page(action="webhooks.manage")
@require_POST
def delivery_resend(request, pk: int, delivery_pk: int):
    webhook = _webhook(request, pk)
    delivery = get_object_or_404(Delivery.objects.filter(webhook=webhook), pk=delivery_pk)
    webhook_services.delivery_resend(delivery=delivery, user=request.user)
    messages.success(request, f"Delivery {delivery.pk} ({delivery.event.type}) queued again.")
    return redirect("portal:webhook", pk=webhook.pk)
