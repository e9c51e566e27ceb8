"""Who may do what in a tenant: one table, one function, one DRF permission class.

How to use it in an API view (next to ``gpushare.api.TenantScopedMixin``)::

    from accounts.permissions import RoleAllows

    class JobViewSet(TenantScopedMixin, ...):
        permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
        required_scopes = {"GET": "jobs:read", "POST": "jobs:write"}
        # by viewset action first, then by HTTP method ("*" = any method)
        required_actions = {"cancel": "jobs.cancel", "GET": "jobs.read", "POST": "jobs.submit"}
        # actions that a role may only do to its own objects (see OWN_ONLY):
        owner_field = "submitted_by_id"

``RoleAllows.has_permission`` refuses (403, the message names the action and
the roles that may do it) when the principal's role lacks the action.
``has_object_permission`` (called by ``get_object()``) refuses an action the
role may do only to its own objects (a member cancelling someone else's job)
unless ``getattr(obj, view.owner_field) == request.user.pk``.

A request made with an API token acts with its creator's *current* role in the
tenant (read from the membership at authentication, so a demoted or removed
user's tokens lose the power at once), never more; the token's scopes are
checked separately by ``gpushare.api.TokenScope``. Portal (session) views use
``role_for(user=..., tenant=...)`` and ``role_allows``.
"""

from __future__ import annotations

from rest_framework import permissions

from .models import Membership, Role
from .tenancy import tenant_scope

OWNER, ADMIN, MEMBER, VIEWER = Role.OWNER, Role.ADMIN, Role.MEMBER, Role.VIEWER
EVERYONE = frozenset({OWNER, ADMIN, MEMBER, VIEWER})
WRITERS = frozenset({OWNER, ADMIN, MEMBER})
MANAGERS = frozenset({OWNER, ADMIN})
OWNERS = frozenset({OWNER})

# The roles table. The docs (docs/accounts.md) show the same table.
ACTIONS: dict[str, frozenset[str]] = {
    "jobs.read": EVERYONE,
    "jobs.submit": WRITERS,
    "jobs.cancel": WRITERS,  # members: their own jobs only (OWN_ONLY)
    "jobs.cancel_any": MANAGERS,
    "usage.read": EVERYONE,
    "quotas.read": EVERYONE,
    "tokens.create": WRITERS,  # for oneself
    "tokens.revoke": WRITERS,  # members: their own tokens only (OWN_ONLY)
    "tokens.revoke_any": MANAGERS,
    "tokens.read_all": MANAGERS,
    "members.read": EVERYONE,
    "members.manage": MANAGERS,  # invite, change roles, remove (owners only touch owners)
    "billing.read": OWNERS,
    "billing.manage": OWNERS,
    "audit.read": OWNERS,
    "tenant.delete": OWNERS,
    "webhooks.manage": MANAGERS,  # register, change, re-send; see deliveries and secrets
}

# An action a role may do only to objects it owns, unless the role also has the "_any" action.
OWN_ONLY: dict[str, str] = {"jobs.cancel": "jobs.cancel_any", "tokens.revoke": "tokens.revoke_any"}

RANK = {VIEWER: 0, MEMBER: 1, ADMIN: 2, OWNER: 3}


def role_allows(role: str | None, action: str) -> bool:
    """Whether ``role`` may do ``action``. An unknown action is refused (fails closed)."""
    return role is not None and role in ACTIONS.get(action, frozenset())


def roles_for(action: str) -> list[str]:
    """The roles allowed ``action``, highest first (for messages and docs)."""
    return sorted(ACTIONS.get(action, ()), key=lambda r: -RANK[r])


def may_act_on(role: str | None, action: str, *, owner_id, user_id) -> bool:
    """``role_allows`` plus the own-objects rule of OWN_ONLY."""
    if not role_allows(role, action):
        return False
    wider = OWN_ONLY.get(action)
    return wider is None or role_allows(role, wider) or (owner_id is not None and owner_id == user_id)


def role_for(*, user, tenant) -> str | None:
    """The user's current role in ``tenant`` (None when not a member)."""
    if user is None or not getattr(user, "pk", None) or tenant is None:
        return None
    with tenant_scope(tenant):
        return Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()


def denied_message(action: str) -> str:
    return f"Your role may not do '{action}'; allowed roles: {', '.join(roles_for(action)) or 'none'}."


def _principal_role(request) -> str | None:
    principal = request.auth
    role = getattr(principal, "role", None)
    if role is not None:
        return role
    tenant = getattr(principal, "tenant", None)
    return role_for(user=request.user, tenant=tenant) if tenant is not None else None


def _required_action(view, request) -> str | None:
    table = getattr(view, "required_actions", {})
    return table.get(getattr(view, "action", None)) or table.get(request.method) or table.get("*")


class RoleAllows(permissions.BasePermission):
    """Refuses what the principal's role may not do (``view.required_actions``)."""

    message = "Your role does not allow this."

    def has_permission(self, request, view) -> bool:
        action = _required_action(view, request)
        if action is None:
            return True
        if role_allows(_principal_role(request), action):
            return True
        self.message = denied_message(action)
        return False

    def has_object_permission(self, request, view, obj) -> bool:
        action = _required_action(view, request)
        if action is None or action not in OWN_ONLY:
            return True
        owner_id = getattr(obj, getattr(view, "owner_field", "user_id"), None)
        user_id = getattr(request.user, "pk", None)
        if may_act_on(_principal_role(request), action, owner_id=owner_id, user_id=user_id):
            return True
        self.message = f"Your role may do '{action}' only to your own objects; '{OWN_ONLY[action]}' needs " + (
            ", ".join(roles_for(OWN_ONLY[action])) + "."
        )
        return False
