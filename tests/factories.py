"""Test data builders (factory_boy) and small helpers shared by the suite."""

from __future__ import annotations

import time
from decimal import Decimal

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Membership, Role, Tenant
from accounts.services import token_create
from billing.models import Price
from scheduler.models import PriorityClass


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}@example.test")
    email = factory.LazyAttribute(lambda u: u.username)
    password = factory.PostGenerationMethodCall("set_password", "correct-horse-battery")


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant

    slug = factory.Sequence(lambda n: f"tenant-{n}")
    name = factory.LazyAttribute(lambda t: t.slug.title())


def member_add(tenant: Tenant, *, role: str = Role.MEMBER, user=None):
    user = user or UserFactory()
    with scopes_disabled():
        Membership.objects.create(tenant=tenant, user=user, role=role)
    return user


def token_for(tenant: Tenant, *, role: str = Role.OWNER, scopes=None, user=None) -> str:
    user = user or member_add(tenant, role=role)
    kwargs = {"scopes": scopes} if scopes is not None else {}
    return token_create(tenant=tenant, user=user, name="test", **kwargs).plaintext


PRICES = {
    ("H100-80GB", "dedicated"): Decimal("2.4900"),
    ("H100-80GB", "shared"): Decimal("2.9900"),
    ("L4-24GB", "dedicated"): Decimal("0.7000"),
    ("L4-24GB", "shared"): Decimal("0.8500"),
}


def platform_rules_seed() -> None:
    """The demo's priority classes and prices (what `make run` seeds)."""
    from console.management.commands.seed_demo import prices_ensure, priority_classes_ensure

    priority_classes_ensure()
    prices_ensure()


def price(model: str, mode: str) -> Decimal:
    return (
        Price.objects.filter(gpu_model=model, mode=mode, effective_from__lte=timezone.now())
        .latest("effective_from")
        .per_gpu_hour
    )


def priority(name: str) -> PriorityClass:
    return PriorityClass.objects.get(name=name)


def wait_for(predicate, *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")
