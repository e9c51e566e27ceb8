"""What every accounts service shares: the error, the role check, token hashing, the audit row."""

from __future__ import annotations

import hashlib

from ..models import AuditLog, Role, Tenant
from ..permissions import denied_message, role_allows, role_for

TOKEN_PREFIX = "gps_"
ALL_SCOPES = ("jobs:read", "jobs:write", "usage:read", "billing:read", "endpoints:invoke")
DEFAULT_SCOPES = ("jobs:read", "jobs:write", "usage:read")


INVITE_VALID_DAYS = 7


class AccountsError(Exception):
    """A request the rules refuse; ``code`` is machine-readable (forbidden, invalid, conflict, not_found)."""

    def __init__(self, message: str, *, code: str = "invalid"):
        super().__init__(message)
        self.code = code


def _require(*, actor, tenant: Tenant, action: str) -> str:
    """The actor's role in ``tenant`` if it allows ``action`` (the platform's staff may do anything)."""
    if getattr(actor, "is_staff", False):
        return Role.OWNER
    role = role_for(user=actor, tenant=tenant)
    if not role_allows(role, action):
        raise AccountsError(denied_message(action), code="forbidden")
    return role


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
