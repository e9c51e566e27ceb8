"""Which tenant a portal page acts for, and what the user's role lets them do.

The tenant comes from the logged-in user's memberships; a user in several
tenants picks one and the choice is kept in the session. Every page runs inside
that tenant's django-scopes scope, so a query on another tenant's rows finds
nothing (another tenant's job is a 404) and a forgotten scope raises.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import redirect, render, resolve_url
from django_scopes import scope, scopes_disabled

from accounts.models import Membership, Tenant
from accounts.permissions import may_act_on, role_allows

SESSION_KEY = "portal_tenant_id"


@dataclass(frozen=True)
class PortalContext:
    tenant: Tenant
    membership: Membership
    memberships: list[Membership]

    @property
    def role(self) -> str:
        return self.membership.role

    def can(self, action: str) -> bool:
        """The role table of accounts.permissions (viewers read, members submit, ...)."""
        return role_allows(self.role, action)

    def may_act_on(self, action: str, *, owner_id) -> bool:
        """``can`` plus the own-objects rule (a member cancels only their own jobs)."""
        return may_act_on(self.role, action, owner_id=owner_id, user_id=self.membership.user_id)


def memberships_of(user) -> list[Membership]:
    with scopes_disabled():  # the signed-in user's memberships in every tenant: how the portal picks one
        return list(
            Membership.objects.filter(user=user, tenant__state__in=[Tenant.State.ACTIVE, Tenant.State.SUSPENDED])
            .select_related("tenant")
            .order_by("tenant__name", "tenant_id")
        )


def portal_context(request) -> PortalContext | None:
    memberships = memberships_of(request.user)
    if not memberships:
        return None
    chosen = request.session.get(SESSION_KEY)
    membership = next((m for m in memberships if m.tenant_id == chosen), memberships[0])
    if chosen != membership.tenant_id:
        request.session[SESSION_KEY] = membership.tenant_id
    return PortalContext(tenant=membership.tenant, membership=membership, memberships=memberships)


def _to_login(request):
    """Log in first. A live part polled by htmx sends the whole page to the login
    form (HX-Redirect) instead of swapping the form into a table cell."""
    if getattr(request, "htmx", False):
        page = request.htmx.current_url_abs_path or "/"
        response = HttpResponse(status=204)
        response["HX-Redirect"] = f"{resolve_url(settings.LOGIN_URL)}?{urlencode({'next': page})}"
        return response
    return redirect_to_login(request.get_full_path())


def _to_console():
    response = HttpResponse(status=204)
    response["HX-Redirect"] = resolve_url("console:index")
    return response


def tenant_page(view=None, *, action: str | None = None):
    """Decorate a portal view: log-in required, tenant chosen, scope entered,
    ``action`` checked against the role (403 if not allowed).

    The view gets ``request.portal`` (a PortalContext) and must render eagerly
    (``render``), so templates evaluate inside the scope.
    """

    def decorate(func):
        @functools.wraps(func)
        def wrapped(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return _to_login(request)
            ctx = portal_context(request)
            if ctx is None:
                if request.user.is_staff:  # the operator: their pages are the console's
                    return _to_console() if getattr(request, "htmx", False) else redirect("console:index")
                return render(request, "portal/no_tenant.html", status=403)
            if action and not ctx.can(action):
                raise PermissionDenied(f"Your role ({ctx.role}) cannot do this ({action}).")
            request.portal = ctx
            with scope(tenant=ctx.tenant):
                return func(request, *args, **kwargs)

        return wrapped

    return decorate(view) if view is not None else decorate
