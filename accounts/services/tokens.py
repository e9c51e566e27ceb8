"""API tokens: issue (the plaintext once, a hash stored) and revoke."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from ..models import ApiToken, Membership, Tenant
from ..permissions import may_act_on, role_for
from ..tenancy import acts_for_tenant, tenant_scope
from .common import ALL_SCOPES, DEFAULT_SCOPES, TOKEN_PREFIX, AccountsError, audit_record, token_hash


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
    with tenant_scope(tenant):
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


@acts_for_tenant("token")
@transaction.atomic
def token_revoke(*, token: ApiToken, actor) -> ApiToken:
    """Revoke a token (its owner, or an admin/owner of the tenant; actor=None: the platform)."""
    if actor is not None and not getattr(actor, "is_staff", False):
        role = role_for(user=actor, tenant=token.tenant)
        if not may_act_on(role, "tokens.revoke", owner_id=token.user_id, user_id=actor.pk):
            raise AccountsError(
                "only the token's owner or an admin/owner of the tenant may revoke it", code="forbidden"
            )
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(actor=actor, tenant=token.tenant, action="token.revoke", target=token.prefix)
    return token
