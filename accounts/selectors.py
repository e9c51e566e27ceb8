"""Read queries for tenants, members, tokens and the audit log.

A selector over a tenant's rows takes the tenant and reads through the caller's scope (the API's
``TenantScopedMixin``, the portal's ``tenant_page``): called outside one it raises ``ScopeError``.
"""

from __future__ import annotations

from types import SimpleNamespace

from django.db import connection
from django.db.models import QuerySet
from django_scopes import scopes_disabled

from .limits import LIMIT_NAMES, Limits, limits_merge
from .models import ApiToken, AuditLog, Invitation, Membership, Plan, Tenant, TenantQuota
from .permissions import role_allows, role_for

DEFAULT_PLAN = "default"


def audit_log_for(*, tenant: Tenant, viewer) -> QuerySet[AuditLog]:
    """The tenant's audit log, for its owners (and the platform's staff); nothing for anyone else."""
    if getattr(viewer, "is_staff", False) or role_allows(role_for(user=viewer, tenant=tenant), "audit.read"):
        return AuditLog.objects.filter(tenant=tenant).select_related("actor")
    return AuditLog.objects.none()


def audit_log_all() -> QuerySet[AuditLog]:
    """Every tenant's entries and the platform's own: the operator's view."""
    return AuditLog.objects.select_related("actor", "tenant")


def members_for(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")


def tokens_for(*, tenant: Tenant, viewer) -> QuerySet[ApiToken]:
    """Admins and owners see every token of the tenant; others their own."""
    tokens = ApiToken.objects.filter(tenant=tenant).select_related("user").order_by("-created_at")
    if not role_allows(role_for(user=viewer, tenant=tenant), "tokens.read_all"):
        tokens = tokens.filter(user=viewer)
    return tokens


def invitations_pending(*, tenant: Tenant) -> QuerySet[Invitation]:
    from django.utils import timezone

    return Invitation.objects.filter(tenant=tenant, accepted_at__isnull=True, expires_at__gt=timezone.now())


def tenants_of(*, user) -> QuerySet[Tenant]:
    """The tenants ``user`` is a member of (tenants are not scoped: each is its own)."""
    return Tenant.objects.filter(memberships__user=user).order_by("slug")


# --- limits (the rows; the arithmetic is accounts.limits, the checks admission/) ---------------------


_LAYERS = ("q", "p", "d")  # the tenant's quota, its plan, the default plan: most specific first


def limits_sql() -> tuple[str, str]:
    """(select list, FROM clause) of a tenant's limit layers, for a statement that reads them with
    something else; the tenant is the parameter ``%(tenant)s``, the default plan's name ``%(default_plan)s``
    (:func:`limits_params`). :func:`limits_from_row` makes the limits of the select list's values."""
    columns = (
        ", ".join(f"{alias}.id" for alias in _LAYERS)
        + ", "
        + ", ".join(f"{alias}.{name}" for alias in _LAYERS for name in LIMIT_NAMES)
    )
    quota_table, plan_table = TenantQuota._meta.db_table, Plan._meta.db_table
    return columns, (
        f"""(SELECT 1 AS one) one
            LEFT JOIN {quota_table} q ON q.tenant_id = %(tenant)s
            LEFT JOIN {plan_table} p ON p.id = q.plan_id
            LEFT JOIN {plan_table} d ON d.name = %(default_plan)s"""
    )


LIMITS_COLUMNS = len(_LAYERS) * (1 + len(LIMIT_NAMES))  # how many values of a row limits_sql's select list gives


def limits_params(tenant: Tenant) -> dict:
    return {"tenant": tenant.pk, "default_plan": DEFAULT_PLAN}


def limits_from_row(row) -> Limits:
    """The limits of the ``LIMITS_COLUMNS`` values of :func:`limits_sql`'s select list."""
    names, layers = LIMIT_NAMES, len(_LAYERS)
    found = []
    for i in range(layers):
        values = row[layers + i * len(names) : layers + (i + 1) * len(names)]
        found.append(SimpleNamespace(**dict(zip(names, values, strict=True))) if row[i] is not None else None)
    return limits_merge(*found)


def limits_for(tenant: Tenant) -> Limits:
    """The tenant's quota over its plan over the ``default`` plan over the built-in defaults, in one query."""
    columns, tables = limits_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {tables}", limits_params(tenant))
        return limits_from_row(cursor.fetchone())


@scopes_disabled()  # every tenant's limits, for the scheduling pass and the budget beat
def limits_all() -> dict[int, tuple[str, Limits]]:
    """Every tenant's (state, limits) by id: the platform-wide read of the scheduler and the budget beat."""
    quotas = {q.tenant_id: q for q in TenantQuota.objects.select_related("plan")}
    default = Plan.objects.filter(name=DEFAULT_PLAN).first()
    out = {}
    for tenant_id, state in Tenant.objects.values_list("pk", "state"):
        quota = quotas.get(tenant_id)
        out[tenant_id] = (state, limits_merge(quota, quota.plan if quota else None, default))
    return out
