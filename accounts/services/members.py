"""People: invitations (one-time links), role changes and removals; a tenant keeps an owner."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from ..models import ApiToken, Invitation, Membership, Role, Tenant
from ..permissions import RANK
from ..tenancy import tenant_scope
from .common import INVITE_VALID_DAYS, AccountsError, _require, audit_record, token_hash


def _owner_guard(*, actor_role: str, role: str) -> None:
    if RANK.get(role, 0) > RANK[actor_role]:
        raise AccountsError(f"a {actor_role} cannot grant or change the {role} role", code="forbidden")


@dataclass(frozen=True)
class IssuedInvitation:
    invitation: Invitation
    plaintext: str


@transaction.atomic
def member_invite(
    *, tenant: Tenant, actor, email: str, role: str = Role.MEMBER, accept_url: str = "", any_address: bool = False
) -> IssuedInvitation:
    """Invite ``email`` to ``tenant`` with ``role``; sends a one-time link (``accept_url`` + the secret).

    The link is accepted only by ``email``'s account (or by creating it), unless an owner
    passes ``any_address=True``: then any signed-in user holding the link may.
    """
    from django.core.mail import send_mail

    actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
    if role not in Role.values:
        raise AccountsError(f"unknown role {role!r}; allowed: {', '.join(Role.values)}")
    _owner_guard(actor_role=actor_role, role=role)
    if any_address and actor_role != Role.OWNER:
        raise AccountsError("only an owner may let an invitation be accepted by another address", code="forbidden")
    email = get_user_model().objects.normalize_email(email).strip().lower()
    with tenant_scope(tenant):
        if Membership.objects.filter(tenant=tenant, user__username__iexact=email).exists():
            raise AccountsError(f"{email} is already a member of {tenant.slug}", code="conflict")
        plaintext = secrets.token_urlsafe(32)
        invitation = Invitation.objects.create(
            tenant=tenant,
            email=email,
            role=role,
            token_hash=token_hash(plaintext),
            invited_by=actor if getattr(actor, "pk", None) else None,
            expires_at=timezone.now() + timedelta(days=INVITE_VALID_DAYS),
            any_address=any_address,
        )
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.invite",
        target=email,
        after={"role": role, **({"any_address": True} if any_address else {})},
    )
    link = invite_link(plaintext, accept_url=accept_url)
    transaction.on_commit(
        lambda: send_mail(
            f"You are invited to {tenant.name} on gpushare",
            f"{getattr(actor, 'username', 'Someone')} invited you to join {tenant.name} as {role}.\n\n"
            f"Accept within {INVITE_VALID_DAYS} days (the link works once):\n{link}\n",
            None,
            [email],
        )
    )
    return IssuedInvitation(invitation=invitation, plaintext=plaintext)


def invite_link(plaintext: str, *, accept_url: str = "") -> str:
    """The one-time link: ``accept_url`` (e.g. ``request.build_absolute_uri("/accounts/invite/")``)
    + the secret, or settings.SITE_URL + the invite page's path."""
    from django.conf import settings
    from django.urls import reverse

    if accept_url:
        return f"{accept_url.rstrip('/')}/{plaintext}/"
    return f"{getattr(settings, 'SITE_URL', '').rstrip('/')}{reverse('invite_accept', kwargs={'secret': plaintext})}"


def invitation_find(plaintext: str) -> Invitation | None:
    """The pending, unexpired invitation for this secret (None otherwise)."""
    with scopes_disabled():  # the secret names the tenant: found before any tenant is known
        return (
            Invitation.objects.select_related("tenant")
            .filter(token_hash=token_hash(plaintext), accepted_at__isnull=True, expires_at__gt=timezone.now())
            .first()
        )


@transaction.atomic
def invite_accept(*, plaintext: str, user=None, password: str | None = None) -> Membership:
    """Use an invitation once: ``user`` (logged in) or a new user named by the invited email joins."""
    with scopes_disabled():  # the secret names the tenant: found before any tenant is known
        invitation = (
            Invitation.objects.select_for_update()
            .select_related("tenant")
            .filter(token_hash=token_hash(plaintext))
            .first()
        )
        if invitation is None or invitation.accepted_at is not None or invitation.expires_at <= timezone.now():
            raise AccountsError("this invitation link is unknown, used or expired", code="not_found")
        if user is None:
            user_model = get_user_model()
            if user_model.objects.filter(username__iexact=invitation.email).exists():
                raise AccountsError(
                    "an account with this email exists: log in, then open the link again", code="conflict"
                )
            if not password:
                raise AccountsError("choose a password")
            user = user_model(username=invitation.email, email=invitation.email)
            user.set_password(password)
            user.save()
        elif not invitation.any_address and not _is_invited(user, invitation.email):
            raise AccountsError(
                f"this invitation is for {invitation.email}; you are signed in as {user.username}. "
                "Log in with that address, or ask an owner to invite your own",
                code="forbidden",
            )
        membership, created = Membership.objects.get_or_create(
            tenant=invitation.tenant, user=user, defaults={"role": invitation.role}
        )
        if not created:
            raise AccountsError(f"you are already a member of {invitation.tenant.slug}", code="conflict")
        invitation.accepted_at = timezone.now()
        invitation.accepted_by = user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(
        actor=user,
        tenant=invitation.tenant,
        action="member.join",
        target=user.username,
        after={"role": membership.role},
    )
    return membership


def _is_invited(user, email: str) -> bool:
    """The signed-in user's address is the invited one (username and email are both addresses here)."""
    email = email.strip().lower()
    return email in {(user.username or "").strip().lower(), (user.email or "").strip().lower()}


def _owners_left(tenant: Tenant, *, excluding: Membership) -> int:
    return Membership.objects.filter(tenant=tenant, role=Role.OWNER).exclude(pk=excluding.pk).count()


@transaction.atomic
def member_role_change(*, membership: Membership, actor, role: str) -> Membership:
    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=membership.tenant_id)
    actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
    if role not in Role.values:
        raise AccountsError(f"unknown role {role!r}; allowed: {', '.join(Role.values)}")
    with tenant_scope(tenant):
        membership = Membership.objects.select_related("user").get(pk=membership.pk)
        _owner_guard(actor_role=actor_role, role=role)
        _owner_guard(actor_role=actor_role, role=membership.role)
        if membership.role == Role.OWNER and role != Role.OWNER and not _owners_left(tenant, excluding=membership):
            raise AccountsError("a tenant keeps at least one owner: make someone else owner first", code="conflict")
        before = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.role_change",
        target=membership.user.username,
        before={"role": before},
        after={"role": role},
    )
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, actor) -> None:
    """Remove a member (or leave, when actor is the member); their tokens stop working with the membership."""
    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=membership.tenant_id)
    with tenant_scope(tenant):
        membership = Membership.objects.select_related("user").get(pk=membership.pk)
        if actor is None or actor.pk != membership.user_id:
            actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
            _owner_guard(actor_role=actor_role, role=membership.role)
        if membership.role == Role.OWNER and not _owners_left(tenant, excluding=membership):
            raise AccountsError("the last owner cannot be removed: make someone else owner first", code="conflict")
        ApiToken.objects.filter(tenant=tenant, user=membership.user, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        membership.delete()
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.remove",
        target=membership.user.username,
        before={"role": membership.role},
    )
