"""Invitations, role changes, removal (never the last owner), and their audit rows."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core import mail
from django.db import connection
from django.utils import timezone
from django_scopes import scope, scopes_disabled

from accounts.models import ApiToken, AuditLog, Invitation, Membership, Role
from accounts.selectors import audit_log_all, audit_log_for, members_for, tokens_for
from accounts.services import (
    AccountsError,
    invitation_find,
    invite_accept,
    member_invite,
    member_remove,
    member_role_change,
    token_create,
)
from tests.factories import UserFactory, member_add

pytestmark = pytest.mark.django_db


def membership(tenant, user) -> Membership:
    with scopes_disabled():
        return Membership.objects.get(tenant=tenant, user=user)


def test_invite_sends_a_one_time_link_and_accepting_creates_the_member(tenant, django_capture_on_commit_callbacks):
    admin = member_add(tenant, role=Role.ADMIN)
    with django_capture_on_commit_callbacks(execute=True):
        issued = member_invite(
            tenant=tenant, actor=admin, email="New.Person@Example.test", role=Role.VIEWER,
            accept_url="http://testserver/accounts/invite/",
        )  # fmt: skip
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["new.person@example.test"]
    link = re.search(r"http://testserver/accounts/invite/(\S+)/", mail.outbox[0].body).group(1)
    assert link == issued.plaintext
    with connection.cursor() as cursor:
        cursor.execute("SELECT token_hash FROM accounts_invitation")
        assert issued.plaintext not in str(cursor.fetchall())  # only the hash is stored
    assert invitation_find(link).email == "new.person@example.test"

    joined = invite_accept(plaintext=link, password="a-long-password-1")
    assert joined.role == Role.VIEWER and joined.user.username == "new.person@example.test"
    assert joined.user.check_password("a-long-password-1")
    assert invitation_find(link) is None
    with pytest.raises(AccountsError, match="unknown, used or expired"):
        invite_accept(plaintext=link, password="another-password")
    actions = list(AuditLog.objects.filter(tenant=tenant).values_list("action", flat=True))
    assert {"member.invite", "member.join"} <= set(actions)


def test_invite_rules(tenant):
    member, admin = member_add(tenant, role=Role.MEMBER), member_add(tenant, role=Role.ADMIN)
    with pytest.raises(AccountsError, match="members.manage"):
        member_invite(tenant=tenant, actor=member, email="x@y.test")
    with pytest.raises(AccountsError, match="cannot grant or change the owner role"):
        member_invite(tenant=tenant, actor=admin, email="x@y.test", role=Role.OWNER)
    with pytest.raises(AccountsError, match="unknown role"):
        member_invite(tenant=tenant, actor=admin, email="x@y.test", role="god")
    with pytest.raises(AccountsError, match="already a member"):
        member_invite(tenant=tenant, actor=admin, email=member.username)


def test_expired_invite_and_existing_account(tenant, other_tenant):
    owner = member_add(tenant, role=Role.OWNER)
    expired = member_invite(tenant=tenant, actor=owner, email="late@x.test")
    with scopes_disabled():
        Invitation.objects.filter(pk=expired.invitation.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    with pytest.raises(AccountsError, match="expired"):
        invite_accept(plaintext=expired.plaintext, password="whatever-1234")
    existing = member_add(other_tenant)
    issued = member_invite(tenant=tenant, actor=owner, email=existing.username)
    with pytest.raises(AccountsError, match="log in, then open the link"):
        invite_accept(plaintext=issued.plaintext, password="pw-123456789")
    assert invite_accept(plaintext=issued.plaintext, user=existing).tenant == tenant


def test_role_change_and_last_owner(tenant):
    owner, admin, member = (member_add(tenant, role=r) for r in (Role.OWNER, Role.ADMIN, Role.MEMBER))
    member_role_change(membership=membership(tenant, member), actor=admin, role=Role.VIEWER)
    assert membership(tenant, member).role == Role.VIEWER
    with pytest.raises(AccountsError, match="cannot grant or change the owner role"):
        member_role_change(membership=membership(tenant, member), actor=admin, role=Role.OWNER)
    with pytest.raises(AccountsError, match="cannot grant or change the owner role"):
        member_role_change(membership=membership(tenant, owner), actor=admin, role=Role.MEMBER)
    with pytest.raises(AccountsError, match="at least one owner"):
        member_role_change(membership=membership(tenant, owner), actor=owner, role=Role.ADMIN)
    with pytest.raises(AccountsError, match="members.manage"):
        member_role_change(membership=membership(tenant, admin), actor=member, role=Role.VIEWER)
    member_role_change(membership=membership(tenant, admin), actor=owner, role=Role.OWNER)
    member_role_change(membership=membership(tenant, owner), actor=admin, role=Role.MEMBER)  # two owners: fine
    entry = AuditLog.objects.filter(tenant=tenant, action="member.role_change").first()
    assert entry.before == {"role": "owner"} and entry.after == {"role": "member"} and entry.actor == admin


def test_remove_member_revokes_tokens_and_keeps_the_last_owner(tenant):
    owner, admin, member = (member_add(tenant, role=r) for r in (Role.OWNER, Role.ADMIN, Role.MEMBER))
    issued = token_create(tenant=tenant, user=member, name="ci")
    member_remove(membership=membership(tenant, member), actor=admin)
    with scopes_disabled():
        assert not Membership.objects.filter(tenant=tenant, user=member).exists()
        assert ApiToken.objects.get(pk=issued.token.pk).revoked_at is not None
    with pytest.raises(AccountsError, match="last owner"):
        member_remove(membership=membership(tenant, owner), actor=owner)
    with pytest.raises(AccountsError, match="cannot grant or change the owner role"):
        member_remove(membership=membership(tenant, owner), actor=admin)
    member_remove(membership=membership(tenant, admin), actor=admin)  # leaving is allowed
    assert AuditLog.objects.filter(tenant=tenant, action="member.remove").count() == 2
    with scope(tenant=tenant):  # selectors read through the caller's scope
        assert [m.user for m in members_for(tenant=tenant)] == [owner]


def test_audit_log_is_for_owners_and_the_operator(tenant, other_tenant):
    owner, admin = member_add(tenant, role=Role.OWNER), member_add(tenant, role=Role.ADMIN)
    stranger_owner = member_add(other_tenant, role=Role.OWNER)
    token_create(tenant=tenant, user=admin, name="ci")
    token_create(tenant=other_tenant, user=stranger_owner, name="theirs")
    assert [e.action for e in audit_log_for(tenant=tenant, viewer=owner)] == ["token.create"]
    assert list(audit_log_for(tenant=tenant, viewer=admin)) == []
    assert list(audit_log_for(tenant=tenant, viewer=stranger_owner)) == []
    operator = UserFactory(is_staff=True)
    assert audit_log_for(tenant=tenant, viewer=operator).count() == 1
    assert audit_log_all().count() == 2


def test_tokens_listing_by_role(tenant):
    admin, member = member_add(tenant, role=Role.ADMIN), member_add(tenant, role=Role.MEMBER)
    token_create(tenant=tenant, user=admin, name="a")
    token_create(tenant=tenant, user=member, name="m")
    with scope(tenant=tenant):  # selectors read through the caller's scope
        assert sorted(t.name for t in tokens_for(tenant=tenant, viewer=admin)) == ["a", "m"]
        assert [t.name for t in tokens_for(tenant=tenant, viewer=member)] == ["m"]


def test_audit_row_is_in_the_same_transaction(tenant):
    """A failing change leaves no audit row behind."""
    owner = member_add(tenant, role=Role.OWNER)
    before = AuditLog.objects.count()
    with pytest.raises(AccountsError):
        member_role_change(membership=membership(tenant, owner), actor=owner, role=Role.VIEWER)
    assert AuditLog.objects.count() == before


def test_invite_link_defaults_to_the_site_url(tenant, settings, django_capture_on_commit_callbacks):
    settings.SITE_URL = "https://gpushare.example/"
    owner = member_add(tenant, role=Role.OWNER)
    with django_capture_on_commit_callbacks(execute=True):
        issued = member_invite(tenant=tenant, actor=owner, email="z@z.test")
    assert f"https://gpushare.example/accounts/invite/{issued.plaintext}/" in mail.outbox[0].body


def test_an_invitation_is_accepted_only_by_the_invited_address(tenant):
    owner = member_add(tenant, role=Role.OWNER)
    invited = UserFactory(username="invited@x.test", email="invited@x.test")
    stranger = UserFactory(username="stranger@x.test", email="stranger@x.test")
    issued = member_invite(tenant=tenant, actor=owner, email="Invited@X.test")

    with pytest.raises(AccountsError, match="this invitation is for invited@x.test") as refused:
        invite_accept(plaintext=issued.plaintext, user=stranger)
    assert refused.value.code == "forbidden"
    with scopes_disabled():
        assert not Membership.objects.filter(tenant=tenant, user=stranger).exists()
        assert Invitation.objects.get(pk=issued.invitation.pk).accepted_at is None  # still usable by its owner
    assert invite_accept(plaintext=issued.plaintext, user=invited).user == invited


def test_an_owner_may_open_an_invitation_to_any_address_and_only_an_owner(tenant):
    owner = member_add(tenant, role=Role.OWNER)
    admin = member_add(tenant, role=Role.ADMIN)
    with pytest.raises(AccountsError, match="only an owner") as refused:
        member_invite(tenant=tenant, actor=admin, email="alias@x.test", any_address=True)
    assert refused.value.code == "forbidden"

    issued = member_invite(tenant=tenant, actor=owner, email="alias@x.test", any_address=True)
    colleague = UserFactory(username="colleague@x.test", email="colleague@x.test")
    assert invite_accept(plaintext=issued.plaintext, user=colleague).user == colleague
    with scopes_disabled():
        invite = AuditLog.objects.get(tenant=tenant, action="member.invite", target="alias@x.test")
    assert invite.after == {"role": Role.MEMBER, "any_address": True}


@pytest.mark.django_db
def test_the_invite_page_refuses_a_signed_in_stranger(client, tenant):
    owner = member_add(tenant, role=Role.OWNER)
    stranger = UserFactory(username="stranger@x.test", email="stranger@x.test")
    issued = member_invite(tenant=tenant, actor=owner, email="invited@x.test")
    client.force_login(stranger)
    response = client.post(f"/accounts/invite/{issued.plaintext}/", follow=True)
    assert "this invitation is for invited@x.test" in response.content.decode()
    with scopes_disabled():
        assert not Membership.objects.filter(tenant=tenant, user=stranger).exists()
