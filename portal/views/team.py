"""Team and tokens: members and roles, invitations, API tokens, audit log."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from accounts import services as accounts_services
from accounts.models import ApiToken, Membership, Role
from accounts.selectors import invitations_pending

from .. import selectors
from ..forms import InviteForm, RoleForm, TokenCreateForm
from ..tenancy import tenant_page
from .common import page


def _team_context(
    request, *, token_form: TokenCreateForm | None = None, issued=None, invite_form: InviteForm | None = None
) -> dict:
    ctx = request.portal
    tenant = ctx.tenant
    manage = ctx.can("members.manage")
    return {
        "invite_form": invite_form or InviteForm(),
        "invitations": list(invitations_pending(tenant=tenant).select_related("invited_by")) if manage else [],
        "roles": Role.choices,
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


@tenant_page(action="members.manage")
@require_POST
def member_invite(request):
    form = InviteForm(request.POST)
    if form.is_valid():
        try:
            accounts_services.member_invite(
                tenant=request.portal.tenant,
                actor=request.user,
                email=form.cleaned_data["email"],
                role=form.cleaned_data["role"],
                accept_url=request.build_absolute_uri("/accounts/invite/"),
                any_address=form.cleaned_data["any_address"],
            )
        except accounts_services.AccountsError as exc:
            field = "any_address" if "another address" in str(exc) else "role"
            form.add_error("email" if exc.code == "conflict" else field, str(exc))
        else:
            messages.success(request, f"Invitation sent to {form.cleaned_data['email']}.")
            return redirect("portal:team")
    return page(request, "portal/team.html", _team_context(request, invite_form=form), status=400)


def _membership(request, pk: int) -> Membership:
    return get_object_or_404(Membership.objects.filter(tenant=request.portal.tenant).select_related("user"), pk=pk)


@tenant_page(action="members.manage")
@require_POST
def member_role(request, pk: int):
    membership = _membership(request, pk)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose one of the roles: " + ", ".join(Role.values) + ".")
        return redirect("portal:team")
    try:
        accounts_services.member_role_change(membership=membership, actor=request.user, role=form.cleaned_data["role"])
    except accounts_services.AccountsError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{membership.user.username} is now {form.cleaned_data['role']}.")
    return redirect("portal:team")


@tenant_page(action="members.manage")
@require_POST
def member_remove(request, pk: int):
    membership = _membership(request, pk)
    try:
        accounts_services.member_remove(membership=membership, actor=request.user)
    except accounts_services.AccountsError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{membership.user.username} removed; their tokens no longer work.")
    return redirect("portal:team")
