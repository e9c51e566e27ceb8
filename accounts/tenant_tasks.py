"""One Celery base class for tasks that act for a tenant: the body runs inside that tenant's scope.

Like pretix's tenant-scoped tasks: a task declares which of its arguments names the tenant, and
``TenantTask`` enters ``django_scopes.scope(tenant=...)`` around the body. A query the body makes
on another tenant's rows then finds nothing, and a task that forgets to declare its tenant cannot
be registered as a ``TenantTask`` at all (``tenant_from`` is checked when the task is created).

    @shared_task(base=TenantTask, tenant_from=("billing.Invoice", "invoice_id"), name="billing.invoice_send")
    def invoice_send_task(*, invoice_id): ...

``tenant_from`` is ``"tenant_id"`` (the task takes the tenant's id) or ``(model label, kwarg)`` (the
task takes the id of a row of a tenant-owned model; its ``tenant_id`` picks the scope). A row that
no longer exists runs the body in an empty scope (it sees no tenant's rows), so a task stays safe
to run twice. Tasks that act for the platform (beat sweeps) or for a node (agents) are not
``TenantTask``s; ``tests/admission/test_tenancy.py`` lists them with the reason.
"""

from __future__ import annotations

import inspect

import celery
from django_scopes import scope

from .tenancy import row_tenant_id


class TenantScopeMissing(RuntimeError):
    """A tenant task was called without the argument that names its tenant."""


class TenantTask(celery.Task):
    abstract = True
    tenant_from: str | tuple[str, str] | None = None

    @classmethod
    def on_bound(cls, app) -> None:
        super().on_bound(app)
        if cls.tenant_from is None:
            raise TypeError(f"{cls.name}: a TenantTask needs tenant_from ('tenant_id' or (model label, kwarg))")

    def tenant_id_for(self, args: tuple, kwargs: dict) -> int | None:
        try:  # positional or keyword, as the task's signature names them
            kwargs = inspect.signature(self.run).bind_partial(*args, **kwargs).arguments
        except TypeError:
            pass
        spec = self.tenant_from
        if spec == "tenant_id":
            if kwargs.get("tenant_id") is None:
                raise TenantScopeMissing(f"{self.name} acts for a tenant: call it with tenant_id=")
            return int(kwargs["tenant_id"])
        label, arg = spec
        if kwargs.get(arg) is None:
            raise TenantScopeMissing(f"{self.name} acts for a tenant: call it with {arg}=")
        return row_tenant_id(label, kwargs[arg])

    def __call__(self, *args, **kwargs):
        tenant_id = self.tenant_id_for(args, kwargs)
        # Never scope(tenant=None): django-scopes reads None as "no filter" (every tenant's rows).
        with scope(tenant=tenant_id if tenant_id is not None else []):
            return super().__call__(*args, **kwargs)
