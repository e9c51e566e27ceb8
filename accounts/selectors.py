"""Read queries for tenants, members, tokens and the audit log."""

from __future__ import annotations

from django.db.models import QuerySet
from django_scopes import scopes_disabled

from .models import ApiToken, AuditLog, Invitation, Membership, Tenant
from .permissions import role_allows, role_for


def audit_log_for(*, tenant: Tenant, viewer) -> QuerySet[AuditLog]:
    """The tenant's audit log, for its owners (and the platform's staff); nothing for anyone else."""
    if getattr(viewer, "is_staff", False) or role_allows(role_for(user=viewer, tenant=tenant), "audit.read"):
        return AuditLog.objects.filter(tenant=tenant).select_related("actor")
    return AuditLog.objects.none()


def audit_log_all() -> QuerySet[AuditLog]:
    """Every tenant's entries and the platform's own: the operator's view."""
    return AuditLog.objects.select_related("actor", "tenant")


def members_for(*, tenant: Tenant) -> QuerySet[Membership]:
    with scopes_disabled():
        return Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")


def tokens_for(*, tenant: Tenant, viewer) -> QuerySet[ApiToken]:
    """Admins and owners see every token of the tenant; others their own."""
    with scopes_disabled():
        tokens = ApiToken.objects.filter(tenant=tenant).select_related("user").order_by("-created_at")
        if not role_allows(role_for(user=viewer, tenant=tenant), "tokens.read_all"):
            tokens = tokens.filter(user=viewer)
        return tokens


def invitations_pending(*, tenant: Tenant) -> QuerySet[Invitation]:
    from django.utils import timezone

    with scopes_disabled():
        return Invitation.objects.filter(tenant=tenant, accepted_at__isnull=True, expires_at__gt=timezone.now())


def tenants_of(*, user) -> QuerySet[Tenant]:
    """The tenants ``user`` is a member of."""
    with scopes_disabled():
        return Tenant.objects.filter(memberships__user=user).order_by("slug")
