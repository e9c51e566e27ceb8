"""Writes for tenants, members and API tokens. Each service is one transaction."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from .models import ApiToken, AuditLog, Membership, Role, Tenant

TOKEN_PREFIX = "gps_"
ALL_SCOPES = ("jobs:read", "jobs:write", "usage:read", "billing:read")
DEFAULT_SCOPES = ("jobs:read", "jobs:write", "usage:read")


def token_hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def audit_record(*, actor, tenant, action: str, target: str = "", before=None, after=None) -> AuditLog:
    return AuditLog.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        tenant=tenant,
        action=action,
        target=target,
        before=before,
        after=after,
    )


@transaction.atomic
def tenant_create(*, slug: str, name: str = "", owner_email: str, owner_password: str | None) -> Tenant:
    """Create a tenant and its owner (or make an existing user its owner)."""
    user_model = get_user_model()
    tenant = Tenant.objects.create(slug=slug, name=name or slug, billing_email=owner_email)
    user, created = user_model.objects.get_or_create(username=owner_email, defaults={"email": owner_email})
    if created or owner_password:
        if owner_password:
            user.set_password(owner_password)
        else:
            user.set_unusable_password()
        user.save()
    with scopes_disabled():
        Membership.objects.create(tenant=tenant, user=user, role=Role.OWNER)
    audit_record(actor=user, tenant=tenant, action="tenant.create", target=slug, after={"owner": owner_email})
    return tenant


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    plaintext: str


@transaction.atomic
def token_create(
    *,
    tenant: Tenant,
    user,
    name: str,
    scopes: tuple[str, ...] | list[str] = DEFAULT_SCOPES,
    expires_days: int | None = None,
    actor=None,
) -> IssuedToken:
    """Issue a token; the plaintext is returned once and never stored."""
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise ValueError(f"unknown scope(s) {', '.join(unknown)}; allowed: {', '.join(ALL_SCOPES)}")
    with scopes_disabled():
        if not Membership.objects.filter(tenant=tenant, user=user).exists():
            raise ValueError(f"{user} is not a member of tenant {tenant.slug}")
        prefix = secrets.token_hex(4)
        plaintext = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days else None
        token = ApiToken.objects.create(
            tenant=tenant,
            user=user,
            name=name,
            prefix=f"{TOKEN_PREFIX}{prefix}",
            token_hash=token_hash(plaintext),
            scopes=sorted(scopes),
            expires_at=expires_at,
        )
    audit_record(
        actor=actor or user,
        tenant=tenant,
        action="token.create",
        target=token.prefix,
        after={"name": name, "scopes": sorted(scopes), "expires_at": expires_at.isoformat() if expires_at else None},
    )
    return IssuedToken(token=token, plaintext=plaintext)


@transaction.atomic
def token_revoke(*, token: ApiToken, actor) -> ApiToken:
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(actor=actor, tenant=token.tenant, action="token.revoke", target=token.prefix)
    return token
