"""Seed the demo `make run` shows: an operator, two tenants with users and
tokens, priority classes, a price list and one simulated node."""

from __future__ import annotations

import json
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import ApiToken, Tenant
from accounts.services import ALL_SCOPES, tenant_create, token_create
from agents.services import node_credential_issue
from billing.models import Price
from endpoints.demo import demo_endpoint_ensure
from scheduler.models import PriorityClass

DEMO_PASSWORD = "gpushare-demo"
OPERATOR = "operator@gpushare.local"
PRICES = {
    ("H100-80GB", "dedicated"): "2.4900",
    ("H100-80GB", "shared"): "2.9900",
    ("L4-24GB", "dedicated"): "0.7000",
    ("L4-24GB", "shared"): "0.8500",
}
CLASSES = [
    # name, rank, preemptible, min runtime s, grace s, multiplier, default for kind
    ("serving", 300, False, 0, 30, "1.000", "inference"),
    ("standard", 200, False, 0, 30, "1.000", "training"),
    ("preemptible", 100, True, 60, 30, "0.600", ""),
]


def priority_classes_ensure() -> None:
    for name, rank, preemptible, min_runtime, grace, mult, default in CLASSES:
        PriorityClass.objects.get_or_create(
            name=name,
            defaults={
                "rank": rank,
                "preemptible": preemptible,
                "min_runtime_s": min_runtime,
                "grace_period_s": grace,
                "price_multiplier": Decimal(mult),
                "default_for_kind": default,
            },
        )
    serving, standard = PriorityClass.objects.get(name="serving"), PriorityClass.objects.get(name="standard")
    preemptible = PriorityClass.objects.get(name="preemptible")
    serving.may_preempt.add(preemptible)
    standard.may_preempt.add(preemptible)


def prices_ensure() -> None:
    start = timezone.now().replace(year=2020, month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
    for (model, mode), price in PRICES.items():
        Price.objects.get_or_create(
            gpu_model=model, mode=mode, effective_from=start, defaults={"per_gpu_hour": Decimal(price)}
        )


class Command(BaseCommand):
    help = "Create the demo data (idempotent). Prints the logins and tokens as JSON on the last line."

    def add_arguments(self, parser):
        parser.add_argument("--node", default="sim-node-1")

    @scopes_disabled()  # seeds the demo's tenants, every one
    @transaction.atomic
    def handle(self, *args, node, **options):
        user_model = get_user_model()
        out: dict = {"password": DEMO_PASSWORD, "tenants": {}}
        # The operator signs in with an email like everyone (a demo seeded before kept "operator").
        operator = "operator" if user_model.objects.filter(username="operator").exists() else OPERATOR
        if not user_model.objects.filter(username=operator).exists():
            user_model.objects.create_superuser(operator, OPERATOR, DEMO_PASSWORD)
        out["operator"] = operator
        priority_classes_ensure()
        prices_ensure()
        for slug, email in (("acme", "alice@acme.test"), ("globex", "bob@globex.test")):
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                tenant = tenant_create(slug=slug, name=slug.title(), owner_email=email, owner_password=DEMO_PASSWORD)
            ApiToken.objects.filter(tenant=tenant, name="demo").update(revoked_at=timezone.now())
            user = user_model.objects.get(username=email)
            issued = token_create(tenant=tenant, user=user, name="demo", scopes=ALL_SCOPES)
            out["tenants"][slug] = {"user": email, "token": issued.plaintext}
            if slug == "acme":  # an endpoint scaled to zero: the README's curl through the gateway
                demo_endpoint_ensure(tenant=tenant, user=user)
        out["node"] = {"name": node, "token": node_credential_issue(name=node)}
        self.stdout.write(json.dumps(out))
