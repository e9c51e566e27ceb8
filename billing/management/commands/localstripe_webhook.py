"""`manage.py localstripe_webhook --url ...`: point localstripe's webhooks at our endpoint (offline demo)."""

from __future__ import annotations

import requests
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Register our webhook endpoint with localstripe (STRIPE_API_BASE), signed with STRIPE_WEBHOOK_SECRET."

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8000/billing/stripe/webhook/")

    def handle(self, *args, url: str, **options):
        if not settings.STRIPE_LOCALSTRIPE:
            raise CommandError("STRIPE_LOCALSTRIPE is off: real Stripe webhooks are set up in the Stripe dashboard")
        try:
            response = requests.post(
                f"{settings.STRIPE_API_BASE}/_config/webhooks/gpushare",
                data={"url": url, "secret": settings.STRIPE_WEBHOOK_SECRET},
                timeout=10,
            )
            response.raise_for_status()
        except requests.RequestException as exc:
            raise CommandError(f"localstripe at {settings.STRIPE_API_BASE} refused the webhook: {exc}") from exc
        self.stdout.write(self.style.SUCCESS(f"localstripe will send events to {url}"))
