"""Entering one tenant's scope: how a service that acts for a tenant reads and writes its rows.

Tenant-owned models use django-scopes' ``ScopedManager``: outside a scope their queries raise
``ScopeError``, inside ``tenant_scope(t)`` they see only ``t``'s rows. A service that acts for one
tenant enters that tenant's scope (``@acts_for_tenant`` or ``with tenant_scope(...)``), so a filter it
forgets narrows to its own tenant instead of reading everyone's. Only code that truly acts across
tenants (the scheduling pass, node reports, beats, the operator's console) uses ``scopes_disabled()``,
with a one-line comment saying why. ``tests/admission/test_service_scopes.py`` walks every service that
takes a tenant and checks each query it makes on a tenant table runs in that tenant's scope.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from django.apps import apps
from django_scopes import scope, scopes_disabled


def tenant_id_of(owner) -> int:
    """The tenant id named by a tenant, a tenant id, or a tenant-owned row (its ``tenant_id``)."""
    if owner is None:
        raise ValueError("no tenant: a tenant scope needs a tenant, its id or one of its rows")
    if isinstance(owner, int):
        return owner
    if hasattr(owner, "tenant_id"):
        return int(owner.tenant_id)
    if getattr(owner, "pk", None) is None:
        raise ValueError(f"{owner!r} names no saved tenant")
    return int(owner.pk)


def tenant_scope(owner):
    """``scope(tenant=...)`` for a tenant, its id, or one of its rows. Never ``scope(tenant=None)``:
    django-scopes reads None as "no filter", which would show every tenant's rows."""
    return scope(tenant=tenant_id_of(owner))


def row_tenant_id(label: str, pk) -> int | None:
    """The tenant id of the ``label`` row ``pk`` (None when it is gone)."""
    with scopes_disabled():  # the one lookup that finds the scope to enter
        return apps.get_model(label).objects.filter(pk=pk).values_list("tenant_id", flat=True).first()


def acts_for_tenant(arg: str | tuple[str, str] | Callable = "tenant"):
    """Run the decorated service in the scope of the tenant its argument ``arg`` names.

    ``arg`` is ``"tenant"`` (a tenant), ``"tenant_id"``, the name of a tenant-owned row argument
    (``"job"``, ``"webhook"``...), or ``(model label, id argument)`` (``("webhooks.Delivery",
    "delivery_id")``): a row that is gone runs the body in an empty scope, where it finds nothing.
    Used bare (``@acts_for_tenant``) it reads ``tenant``.
    """
    if callable(arg):
        return acts_for_tenant("tenant")(arg)
    label, name = arg if isinstance(arg, tuple) else (None, arg)

    def decorate(func):
        signature = inspect.signature(func)
        if name not in signature.parameters:
            raise TypeError(f"{func.__qualname__} has no argument {name!r} to take its tenant from")

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if name in kwargs:  # services take keyword-only arguments: the cheap path
                owner = kwargs[name]
            else:
                owner = signature.bind_partial(*args, **kwargs).arguments.get(name)
            if label is None:
                entered = tenant_scope(owner)
            else:
                tenant_id = row_tenant_id(label, owner)
                entered = scope(tenant=tenant_id if tenant_id is not None else [])
            with entered:
                return func(*args, **kwargs)

        wrapper.tenant_from = arg
        return wrapper

    return decorate
