"""`manage.py payment_method_set --tenant SLUG --payment-method pm_card_visa`: a tenant's default card.

In the portal the payment method comes from Stripe.js; this is for operators and
the offline demo (Stripe test methods: pm_card_visa, pm_card_chargeCustomerFail).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from accounts.models import Tenant
from billing.gateway import GatewayError
from billing.services.payments import payment_method_set


class Command(BaseCommand):
    help = "Attach a Stripe payment method to a tenant's customer and make it the default."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--payment-method", required=True, help="a pm_... id, e.g. pm_card_visa in test mode")

    def handle(self, *args, tenant: str, payment_method: str, **options):
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"no tenant {tenant!r}")
        if not payment_method.startswith("pm_"):
            raise CommandError("a payment method id starts with pm_")
        try:
            card = payment_method_set(tenant=found, payment_method_id=payment_method)
        except GatewayError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(self.style.SUCCESS(f"{tenant}: {card.brand} •••• {card.last4} is the default"))
