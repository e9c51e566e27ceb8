"""Team and tokens: a token is shown once and never stored in plaintext, revocation
works, owners invite and manage members, members cannot."""

from __future__ import annotations

import pytest
from django.contrib.sessions.models import Session
from django.core import mail
from django.db import connection
from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import ApiToken, AuditLog, Invitation, Membership, Role
from tests.factories import member_add

pytestmark = pytest.mark.django_db


def test_token_is_shown_once_works_and_is_not_stored(client_for, tenant, api_client_for):
    owner = client_for(tenant)
    response = owner.post(
        reverse("portal:token_create"), {"name": "gha", "scopes": ["jobs:read"], "expires_days": "30"}
    )
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    page = response.content.decode()
    secret = page.split('<pre id="new-token">', 1)[1].split("</pre>", 1)[0]
    assert secret.startswith("gps_") and "shown <strong>only once</strong>" in page
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api.get("/api/v1/jobs/").status_code == 200
    assert api.post("/api/v1/jobs/", {}, format="json").status_code == 403  # jobs:read only
    assert secret not in owner.get(reverse("portal:team")).content.decode()
    # Not in any table: the token row holds a hash, sessions and audit rows never see it.
    with connection.cursor() as cursor:
        for table in ("accounts_apitoken", "accounts_auditlog", "django_session"):
            cursor.execute(f"SELECT * FROM {table}")
            assert all(secret not in str(row) for row in cursor.fetchall()), table
    assert all(secret not in s.get_decoded().__repr__() for s in Session.objects.all())


def test_bad_token_form_keeps_input_and_says_why(client_for, tenant):
    page = client_for(tenant).post(reverse("portal:token_create"), {"name": "kept-name", "scopes": ["root"]})
    assert page.status_code == 400
    assert "kept-name" in page.content.decode() and "Select a valid choice" in page.content.decode()


def test_revoke_by_owner_and_members_only_their_own(client_for, tenant):
    from accounts.services import token_create

    owner = client_for(tenant)
    alice = client_for(tenant, role=Role.MEMBER)
    owners = token_create(tenant=tenant, user=owner.user, name="owner-ci").token
    alices = token_create(tenant=tenant, user=alice.user, name="alice-ci").token
    assert "owner-ci" not in alice.get(reverse("portal:team")).content.decode()
    assert alice.post(reverse("portal:token_revoke", kwargs={"pk": owners.pk})).status_code == 404
    assert alice.post(reverse("portal:token_revoke", kwargs={"pk": alices.pk})).status_code == 302
    assert owner.post(reverse("portal:token_revoke", kwargs={"pk": owners.pk})).status_code == 302
    with scopes_disabled():
        assert ApiToken.objects.filter(pk__in=[owners.pk, alices.pk], revoked_at__isnull=False).count() == 2
        assert AuditLog.objects.filter(tenant=tenant, action="token.revoke").count() == 2


def test_owner_invites_changes_role_and_removes(client_for, tenant, django_capture_on_commit_callbacks):
    owner = client_for(tenant)
    with django_capture_on_commit_callbacks(execute=True):  # the email goes out after commit
        response = owner.post(reverse("portal:member_invite"), {"email": "new@acme.test", "role": "viewer"})
    assert response.status_code == 302
    with scopes_disabled():
        invitation = Invitation.objects.get(tenant=tenant)
    assert (invitation.email, invitation.role) == ("new@acme.test", "viewer")
    assert len(mail.outbox) == 1 and "/accounts/invite/" in mail.outbox[0].body
    assert "new@acme.test as viewer" in owner.get(reverse("portal:team")).content.decode()

    bob = member_add(tenant, role=Role.MEMBER)
    with scopes_disabled():
        bobs = Membership.objects.get(tenant=tenant, user=bob)
    owner.post(reverse("portal:member_role", kwargs={"pk": bobs.pk}), {"role": "admin"})
    with scopes_disabled():
        assert Membership.objects.get(pk=bobs.pk).role == Role.ADMIN
    owner.post(reverse("portal:member_remove", kwargs={"pk": bobs.pk}))
    with scopes_disabled():
        assert not Membership.objects.filter(pk=bobs.pk).exists()


def test_invite_errors_stay_on_the_form(client_for, tenant):
    owner = client_for(tenant)
    page = owner.post(reverse("portal:member_invite"), {"email": owner.user.username, "role": "member"})
    assert page.status_code == 400
    assert "already a member" in page.content.decode()
    page = owner.post(reverse("portal:member_invite"), {"email": "not-an-email", "role": "member"})
    assert page.status_code == 400 and "not-an-email" in page.content.decode()


def test_members_and_viewers_cannot_manage_the_team(client_for, tenant):
    owner = client_for(tenant)
    with scopes_disabled():
        owners = Membership.objects.get(tenant=tenant, user=owner.user)
    for role in (Role.MEMBER, Role.VIEWER):
        other = client_for(tenant, role=role)
        assert other.post(reverse("portal:member_invite"), {"email": "x@y.test", "role": "owner"}).status_code == 403
        assert (
            other.post(reverse("portal:member_role", kwargs={"pk": owners.pk}), {"role": "viewer"}).status_code == 403
        )
        assert other.post(reverse("portal:member_remove", kwargs={"pk": owners.pk})).status_code == 403
        assert "Invite someone" not in other.get(reverse("portal:team")).content.decode()
    with scopes_disabled():
        assert Membership.objects.get(pk=owners.pk).role == Role.OWNER
        assert not Invitation.objects.filter(tenant=tenant).exists()


def test_another_tenants_member_is_404(client_for, tenant, other_tenant):
    theirs = member_add(other_tenant, role=Role.MEMBER)
    with scopes_disabled():
        membership = Membership.objects.get(tenant=other_tenant, user=theirs)
    owner = client_for(tenant)
    assert owner.post(reverse("portal:member_role", kwargs={"pk": membership.pk}), {"role": "owner"}).status_code == 404
    assert owner.post(reverse("portal:member_remove", kwargs={"pk": membership.pk})).status_code == 404
    with scopes_disabled():
        assert Membership.objects.get(pk=membership.pk).role == Role.MEMBER


def test_owner_sets_a_stripe_test_card_on_localstripe(client_for, tenant, localstripe):
    owner = client_for(tenant)
    page = owner.get(reverse("portal:usage")).content.decode()
    assert 'value="pm_card_visa"' in page
    response = owner.post(reverse("portal:payment_method"), {"payment_method": "pm_card_visa"}, follow=True)
    assert "Visa ending 4242 is now the default payment method." in response.content.decode()
    tenant.refresh_from_db()
    assert tenant.stripe_customer_id.startswith("cus_")
    refused = owner.post(reverse("portal:payment_method"), {"payment_method": "tok_anything"}, follow=True)
    assert "Choose one of the listed test cards" in refused.content.decode()
    # Only owners manage billing.
    admin = client_for(tenant, role=Role.ADMIN)
    assert admin.post(reverse("portal:payment_method"), {"payment_method": "pm_card_visa"}).status_code == 403
    assert 'value="pm_card_visa"' not in admin.get(reverse("portal:usage")).content.decode()
