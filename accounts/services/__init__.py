"""Writes for tenants, members, API tokens and quotas. Each service is one transaction and
writes its audit row (``audit_record``) in that transaction.

    common.py   AccountsError, token_hash, audit_record
    tenants.py  tenant_create, signup_create, quota_set, tenant_suspend, tenant_reinstate
    (the budget beat: admission.services.budgets_enforce)
    tokens.py   token_create, token_revoke
    members.py  member_invite, invite_accept, member_role_change, member_remove
"""

from .common import (
    ALL_SCOPES,
    DEFAULT_SCOPES,
    INVITE_VALID_DAYS,
    TOKEN_PREFIX,
    AccountsError,
    audit_record,
    token_hash,
)
from .members import (
    IssuedInvitation,
    invitation_find,
    invite_accept,
    invite_link,
    member_invite,
    member_remove,
    member_role_change,
)
from .tenants import (
    QUOTA_FIELDS,
    quota_set,
    signup_create,
    tenant_create,
    tenant_reinstate,
    tenant_suspend,
)
from .tokens import IssuedToken, token_create, token_revoke

__all__ = [
    "ALL_SCOPES",
    "DEFAULT_SCOPES",
    "INVITE_VALID_DAYS",
    "QUOTA_FIELDS",
    "TOKEN_PREFIX",
    "AccountsError",
    "IssuedInvitation",
    "IssuedToken",
    "audit_record",
    "invitation_find",
    "invite_accept",
    "invite_link",
    "member_invite",
    "member_remove",
    "member_role_change",
    "quota_set",
    "signup_create",
    "tenant_create",
    "tenant_reinstate",
    "tenant_suspend",
    "token_create",
    "token_hash",
    "token_revoke",
]
