"""Sign-up, invitation pages, login with brute-force lockout (django-axes), logout, password reset."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from django_scopes import scopes_disabled

from accounts.models import Membership, Role, Tenant
from accounts.services import member_invite
from tests.factories import UserFactory, member_add

pytestmark = pytest.mark.django_db
PASSWORD = "correct-horse-battery"


def test_signup_creates_the_tenant_and_its_owner(client):
    page = client.get("/accounts/signup/")
    assert page.status_code == 200
    assert b'<label for="id_organisation">' in page.content
    response = client.post(
        "/accounts/signup/",
        {"organisation": "Hooli", "slug": "hooli", "email": "Gavin@Hooli.test", "password1": "nucleus-rocks-9",
         "password2": "nucleus-rocks-9"},
    )  # fmt: skip
    assert response.status_code == 302
    tenant = Tenant.objects.get(slug="hooli")
    with scopes_disabled():
        owner = Membership.objects.get(tenant=tenant)
    assert owner.role == Role.OWNER and owner.user.username == "gavin@hooli.test"
    assert owner.user.check_password("nucleus-rocks-9")
    assert client.session["_auth_user_id"] == str(owner.user.pk)


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"slug": "tenant-a"}, "slug", "taken"),
        ({"slug": "api"}, "slug", "taken"),
        ({"slug": "no spaces"}, "slug", "letters, numbers, underscores or hyphens"),
        ({"email": "EXISTING"}, "email", "log in instead"),
        ({"password2": "different-pw-1"}, "password2", "differ"),
        ({"password1": "short", "password2": "short"}, "password1", "too short"),
    ],
)
def test_signup_refuses_with_a_reason(client, tenant, change, field, message):
    existing = UserFactory()
    data = {"organisation": "X", "slug": "fresh", "email": "new@x.test", "password1": "pw-long-enough-1",
            "password2": "pw-long-enough-1"}  # fmt: skip
    data.update({k: existing.username if v == "EXISTING" else v for k, v in change.items()})
    response = client.post("/accounts/signup/", data)
    assert response.status_code == 200
    assert message in " ".join(response.context["form"].errors[field])
    assert not Tenant.objects.filter(slug="fresh").exists()
    existing.refresh_from_db()
    assert existing.check_password(PASSWORD)  # never touched by a sign-up attempt


def test_invite_page_new_user(client, tenant):
    admin = member_add(tenant, role=Role.ADMIN)
    issued = member_invite(tenant=tenant, actor=admin, email="dinesh@x.test", role=Role.MEMBER)
    url = f"/accounts/invite/{issued.plaintext}/"
    page = client.get(url)
    assert page.status_code == 200 and b"Join Tenant-A" in page.content
    assert client.post(url, {"password1": "pied-piper-99", "password2": "pied-piper-99"}).status_code == 302
    user = get_user_model().objects.get(username="dinesh@x.test")
    with scopes_disabled():
        assert Membership.objects.get(tenant=tenant, user=user).role == Role.MEMBER
    assert client.get(url).status_code == 404  # one time only
    assert Client().get("/accounts/invite/not-a-real-secret/").status_code == 404


def test_invite_page_logged_in_user(client, tenant, other_tenant):
    owner = member_add(tenant, role=Role.OWNER)
    elsewhere = member_add(other_tenant)
    issued = member_invite(tenant=tenant, actor=owner, email=elsewhere.username, role=Role.VIEWER)
    client.force_login(elsewhere)
    assert client.post(f"/accounts/invite/{issued.plaintext}/").status_code == 302
    with scopes_disabled():
        assert Membership.objects.get(tenant=tenant, user=elsewhere).role == Role.VIEWER


def test_login_logout(client):
    user = UserFactory()
    assert client.get("/accounts/login/").status_code == 200
    response = client.post("/accounts/login/", {"username": user.username, "password": PASSWORD})
    assert response.status_code == 302 and client.session["_auth_user_id"] == str(user.pk)
    assert client.post("/accounts/logout/").status_code == 302
    assert "_auth_user_id" not in client.session


def test_login_lockout_after_five_failures(settings):
    assert settings.AXES_FAILURE_LIMIT == 5
    victim, bystander = UserFactory(), UserFactory()
    attacker = Client(REMOTE_ADDR="203.0.113.7")
    for _ in range(4):
        response = attacker.post("/accounts/login/", {"username": victim.username, "password": "guess"})
        assert response.status_code == 200  # the form again, with an error
    locked = attacker.post("/accounts/login/", {"username": victim.username, "password": "guess"})
    assert locked.status_code == 429
    assert b"Too many failed logins" in locked.content
    # now even the right password is refused from there
    again = attacker.post("/accounts/login/", {"username": victim.username, "password": PASSWORD})
    assert again.status_code == 429 and "_auth_user_id" not in attacker.session
    # the same user from another address, and another user from the same address, still log in
    assert (
        Client(REMOTE_ADDR="198.51.100.1")
        .post("/accounts/login/", {"username": victim.username, "password": PASSWORD})
        .status_code
        == 302
    )
    assert attacker.post("/accounts/login/", {"username": bystander.username, "password": PASSWORD}).status_code == 302


def test_password_reset_flow(client):
    user = UserFactory(username="monica@x.test", email="monica@x.test")
    assert client.post("/accounts/password_reset/", {"email": "monica@x.test"}).status_code == 302
    assert len(mail.outbox) == 1 and mail.outbox[0].subject == "Reset your gpushare password"
    link = re.search(r"http://testserver(/accounts/reset/\S+/)", mail.outbox[0].body).group(1)
    form = client.get(link, follow=True)
    assert form.status_code == 200 and b"Choose a new password" in form.content
    done = client.post(
        form.redirect_chain[-1][0], {"new_password1": "bachman-9-lives", "new_password2": "bachman-9-lives"}
    )
    assert done.status_code == 302
    user.refresh_from_db()
    assert user.check_password("bachman-9-lives")
    client.post("/accounts/password_reset/", {"email": "nobody@x.test"})
    assert len(mail.outbox) == 1  # no email for an unknown address, and the same answer


def test_signup_service_never_takes_over_an_existing_account():
    """Even if the form's check is raced, the service refuses an existing email and writes nothing."""
    from django.db import IntegrityError

    from accounts.services import signup_create

    victim = UserFactory(username="ceo@x.test")
    with pytest.raises(IntegrityError):
        signup_create(organisation="Evil", slug="evil", email="ceo@x.test", password="attacker-pw-1")
    victim.refresh_from_db()
    assert victim.check_password(PASSWORD)
    assert not Tenant.objects.filter(slug="evil").exists()


def test_password_change(client):
    user = UserFactory()
    client.force_login(user)
    page = client.get("/accounts/password_change/")
    assert page.status_code == 200 and b"Change your password" in page.content
    response = client.post(
        "/accounts/password_change/",
        {"old_password": PASSWORD, "new_password1": "erlich-bachman-2", "new_password2": "erlich-bachman-2"},
    )
    assert response.status_code == 302
    user.refresh_from_db()
    assert user.check_password("erlich-bachman-2")
    assert b"Your password is changed" in client.get("/accounts/password_change/done/").content
