"""What every portal page shares: rendering with the tenant context, switching tenant."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from ..tenancy import SESSION_KEY, memberships_of


def page(request, template: str, context: dict | None = None, *, status: int = 200):
    """Render eagerly (inside the tenant scope) with the portal's shared context."""
    ctx = request.portal
    base = {
        "tenant": ctx.tenant,
        "membership": ctx.membership,
        "memberships": ctx.memberships,
        "can_submit": ctx.can("jobs.submit"),
        "can_cancel": ctx.can("jobs.cancel"),
        "can_manage": ctx.can("members.manage"),
    }
    return render(request, template, {**base, **(context or {})}, status=status)


@login_required
@require_POST
def tenant_switch(request):
    """Choose which of the user's tenants the portal acts for."""
    raw = request.POST.get("tenant", "")
    chosen = next((m for m in memberships_of(request.user) if str(m.tenant_id) == raw), None)
    if chosen is None:
        raise Http404("You are not a member of that tenant.")
    request.session[SESSION_KEY] = chosen.tenant_id
    target = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        target = "/"
    return HttpResponseRedirect(target)
