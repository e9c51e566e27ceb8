"""The operator's pages for tokens, members and invitations: readable across tenants, writes via services."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from accounts.models import ApiToken, AuditLog, Role
from accounts.services import member_invite, token_create
from tests.factories import UserFactory, member_add

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator_client(client):
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def test_operator_lists_tokens_members_invitations_of_all_tenants(operator_client, tenant, other_tenant):
    owner_a, owner_b = member_add(tenant, role=Role.OWNER), member_add(other_tenant, role=Role.OWNER)
    issued = token_create(tenant=tenant, user=owner_a, name="ci-a")
    token_create(tenant=other_tenant, user=owner_b, name="ci-b")
    member_invite(tenant=tenant, actor=owner_a, email="inv@a.test")
    tokens = operator_client.get("/admin/accounts/apitoken/")
    assert tokens.status_code == 200
    assert b"ci-a" in tokens.content and b"ci-b" in tokens.content
    assert issued.token.token_hash.encode() not in tokens.content
    detail = operator_client.get(f"/admin/accounts/apitoken/{issued.token.pk}/change/")
    assert detail.status_code == 200 and issued.token.token_hash.encode() not in detail.content
    members = operator_client.get("/admin/accounts/membership/")
    assert members.status_code == 200 and owner_a.username.encode() in members.content
    assert owner_b.username.encode() in members.content
    invitations = operator_client.get("/admin/accounts/invitation/")
    assert invitations.status_code == 200 and b"inv@a.test" in invitations.content


def test_operator_revokes_a_token_with_an_audit_row(operator_client, tenant):
    owner = member_add(tenant, role=Role.OWNER)
    issued = token_create(tenant=tenant, user=owner, name="ci")
    response = operator_client.post(
        "/admin/accounts/apitoken/", {"action": "revoke", "_selected_action": [issued.token.pk]}
    )
    assert response.status_code == 302
    with scopes_disabled():
        assert ApiToken.objects.get(pk=issued.token.pk).revoked_at is not None
    entry = AuditLog.objects.get(tenant=tenant, action="token.revoke")
    assert entry.actor.is_staff


def test_non_staff_cannot_open_the_console(client, tenant):
    client.force_login(member_add(tenant, role=Role.OWNER))
    assert client.get("/admin/accounts/apitoken/").status_code == 302  # to the admin login
