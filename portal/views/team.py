"""Team and tokens: members and roles, invitations, API tokens, audit log."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from accounts import services as accounts_services
from accounts.models import ApiToken

from .. import selectors
from ..forms import TokenCreateForm
from ..tenancy import tenant_page
from .common import page


def _team_context(request, *, token_form: TokenCreateForm | None = None, issued=None) -> dict:
    ctx = request.portal
    tenant = ctx.tenant
    return {
        "members": selectors.members(tenant=tenant),
        "tokens": selectors.tokens(tenant=tenant, user=request.user, see_all=ctx.can("tokens.read_all")),
        "token_form": token_form or TokenCreateForm(),
        "issued": issued,
        "audit": selectors.audit_entries(tenant=tenant) if ctx.can("audit.read") else None,
        "can_tokens": ctx.can("tokens.create"),
    }


@tenant_page
def team(request):
    return page(request, "portal/team.html", _team_context(request))


@tenant_page(action="tokens.create")
@require_POST
def token_create(request):
    form = TokenCreateForm(request.POST)
    if not form.is_valid():
        return page(request, "portal/team.html", _team_context(request, token_form=form), status=400)
    issued = accounts_services.token_create(
        tenant=request.portal.tenant,
        user=request.user,
        name=form.cleaned_data["name"],
        scopes=form.cleaned_data["scopes"],
        expires_days=form.cleaned_data["expires_days"],
    )
    # Shown once, in this response only: the plaintext is never stored (not even in the session).
    response = page(request, "portal/team.html", _team_context(request, issued=issued))
    response["Cache-Control"] = "no-store"
    return response


@tenant_page(action="tokens.revoke")
@require_POST
def token_revoke(request, pk: int):
    token = get_object_or_404(ApiToken.objects.filter(tenant=request.portal.tenant), pk=pk)
    if not request.portal.may_act_on("tokens.revoke", owner_id=token.user_id):
        raise Http404("No such token.")  # someone else's token: as if it did not exist
    accounts_services.token_revoke(token=token, actor=request.user)
    messages.success(request, f"Token {token.prefix}… revoked; requests with it now get 401.")
    return redirect("portal:team")
