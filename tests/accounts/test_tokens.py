"""API tokens: stored only as a hash, revocable, expiring, scoped, last-used; the management commands."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone
from django_scopes import scopes_disabled
from rest_framework.test import APIClient

from accounts.models import ApiToken, AuditLog, Role, Tenant
from accounts.services import AccountsError, token_create, token_revoke
from tests.factories import UserFactory, member_add

pytestmark = pytest.mark.django_db


def client_with(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def database_text() -> str:
    """Every row of every table of the project, as JSON text."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cursor.fetchall()]
        chunks = []
        for table in tables:
            cursor.execute(f"SELECT coalesce(string_agg(row_to_json(t)::text, E'\\n'), '') FROM \"{table}\" t")
            chunks.append(cursor.fetchone()[0])
    return "\n".join(chunks)


def test_create_token_command_prints_once_and_stores_only_a_hash(tenant):
    user = member_add(tenant, role=Role.MEMBER)
    out = StringIO()
    call_command(
        "create_token", "--tenant", tenant.slug, "--user", user.username, "--name", "ci",
        "--scopes", "jobs:read", "jobs:write", "--expires", "30", stdout=out,
    )  # fmt: skip
    lines = out.getvalue().strip().splitlines()
    plaintext = lines[-1]
    assert plaintext.startswith("gps_") and len(plaintext) > 40
    assert plaintext not in lines[0]
    secret = plaintext.split("_", 2)[2]

    dump = database_text()
    assert "ci" in dump and len(dump) > 1000  # the dump does contain the data
    assert plaintext not in dump and secret not in dump

    with scopes_disabled():
        token = ApiToken.objects.get(name="ci")
    assert plaintext.startswith(token.prefix)
    assert token.scopes == ["jobs:read", "jobs:write"]
    assert timedelta(days=29, hours=23) < token.expires_at - timezone.now() <= timedelta(days=30)
    assert client_with(plaintext).get("/api/v1/jobs/").status_code == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "nope", "--user", "u@x.test", "--name", "n"], "no tenant 'nope'"),
        (["--tenant", "tenant-a", "--user", "nobody@x.test", "--name", "n"], "no user 'nobody@x.test'"),
        (["--tenant", "tenant-a", "--user", "MEMBER", "--name", "n", "--expires", "0"], "positive number of days"),
        (["--tenant", "tenant-a", "--user", "STRANGER", "--name", "n"], "is not a member of tenant tenant-a"),
    ],
)
def test_create_token_command_errors(tenant, args, message):
    member, stranger = member_add(tenant), UserFactory()
    args = [{"MEMBER": member.username, "STRANGER": stranger.username}.get(a, a) for a in args]
    with pytest.raises(CommandError, match=message):
        call_command("create_token", *args, stdout=StringIO())


def test_create_token_command_rejects_unknown_scope(tenant):
    member = member_add(tenant)
    with pytest.raises(CommandError, match="invalid choice"):
        call_command(
            "create_token", "--tenant", tenant.slug, "--user", member.username, "--name", "n",
            "--scopes", "root", stdout=StringIO(), stderr=StringIO(),
        )  # fmt: skip


def test_create_tenant_command():
    out = StringIO()
    call_command("create_tenant", "initech", "--owner", "peter@initech.test", "--password", "tps-report-1", stdout=out)
    tenant = Tenant.objects.get(slug="initech")
    assert "created tenant initech" in out.getvalue()
    assert AuditLog.objects.filter(tenant=tenant, action="tenant.create").exists()
    with pytest.raises(CommandError, match="already exists"):
        call_command("create_tenant", "initech", "--owner", "x@y.test", stdout=StringIO())


def test_default_scopes_exclude_billing(tenant):
    issued = token_create(tenant=tenant, user=member_add(tenant), name="d")
    assert issued.token.scopes == ["jobs:read", "jobs:write", "usage:read"]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("unknown", "Unknown API token."),
        ("revoked", "This API token has been revoked."),
        ("expired", "This API token has expired."),
        ("inactive", "The user this token belongs to is inactive."),
        ("removed", "The token's user is no longer a member of its tenant."),
        ("malformed", "Malformed Authorization header"),
    ],
)
def test_refused_tokens_get_401_with_a_clear_message(tenant, state, message):
    user = member_add(tenant)
    issued = token_create(tenant=tenant, user=user, name="t")
    header = f"Bearer {issued.plaintext}"
    with scopes_disabled():
        if state == "unknown":
            header = f"Bearer {issued.plaintext[:-3]}xyz"
        elif state == "revoked":
            token_revoke(token=issued.token, actor=user)
        elif state == "expired":
            ApiToken.objects.filter(pk=issued.token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        elif state == "inactive":
            type(user).objects.filter(pk=user.pk).update(is_active=False)
        elif state == "removed":
            user.memberships.all().delete()
        elif state == "malformed":
            header = f"Bearer {issued.plaintext} extra"
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/v1/jobs/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert message in response.json()["error"]["message"]
    assert response["WWW-Authenticate"] == "Bearer"


def test_scheme_is_case_insensitive(tenant):
    issued = token_create(tenant=tenant, user=member_add(tenant), name="t")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"bearer {issued.plaintext}")
    assert client.get("/api/v1/jobs/").status_code == 200


@pytest.mark.parametrize("header", ["   ", "\t", "Basic dXNlcjpwdw==", "Bearer"])
def test_an_empty_or_other_scheme_authorization_is_no_credentials_not_a_500(tenant, header):
    response = APIClient().get("/api/v1/jobs/", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401, response.content
    assert response.json()["error"]["code"] == "unauthenticated"


def test_no_credentials_get_401(tenant):
    response = APIClient().get("/api/v1/jobs/")
    assert response.status_code == 401
    assert "Authorization: Bearer" in response.json()["error"]["message"]


def test_missing_scope_gets_403(rules, tenant):
    read_only = token_create(tenant=tenant, user=member_add(tenant), name="ro", scopes=["jobs:read"]).plaintext
    client = client_with(read_only)
    assert client.get("/api/v1/jobs/").status_code == 200
    response = client.post("/api/v1/jobs/", {"kind": "training", "gpus": 1, "command": ["true"]}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"
    assert "jobs:write" in response.json()["error"]["message"]
    write_only = token_create(tenant=tenant, user=member_add(tenant), name="wo", scopes=["jobs:write"]).plaintext
    assert client_with(write_only).get("/api/v1/jobs/").status_code == 403


def test_last_used_is_recorded_at_a_minute_resolution(tenant, monkeypatch):
    issued = token_create(tenant=tenant, user=member_add(tenant), name="t")
    assert issued.token.last_used_at is None
    client = client_with(issued.plaintext)
    client.get("/api/v1/jobs/")
    with scopes_disabled():
        first = ApiToken.objects.get(pk=issued.token.pk).last_used_at
    assert first is not None and timezone.now() - first < timedelta(seconds=30)
    client.get("/api/v1/jobs/")
    with scopes_disabled():
        assert ApiToken.objects.get(pk=issued.token.pk).last_used_at == first  # no write per request
    # Two minutes later (the check itself may come from the principal cache): written again.
    later = timezone.now() + timedelta(minutes=2)
    monkeypatch.setattr("accounts.authentication.timezone.now", lambda: later)
    client.get("/api/v1/jobs/")
    with scopes_disabled():
        assert ApiToken.objects.get(pk=issued.token.pk).last_used_at > first


def test_who_may_revoke(tenant):
    owner_of_token, colleague = member_add(tenant, role=Role.MEMBER), member_add(tenant, role=Role.MEMBER)
    admin = member_add(tenant, role=Role.ADMIN)
    issued = token_create(tenant=tenant, user=owner_of_token, name="t")
    with pytest.raises(AccountsError, match="only the token's owner or an admin"):
        token_revoke(token=issued.token, actor=colleague)
    token_revoke(token=issued.token, actor=admin)
    token_revoke(token=issued.token, actor=admin)  # twice: one audit entry
    assert AuditLog.objects.filter(tenant=tenant, action="token.revoke").count() == 1
    assert AuditLog.objects.get(tenant=tenant, action="token.revoke").actor == admin
    mine = token_create(tenant=tenant, user=colleague, name="mine")
    token_revoke(token=mine.token, actor=colleague)
    assert mine.token.revoked_at is not None


def test_token_create_validates_and_audits(tenant, other_tenant):
    user = member_add(tenant)
    with pytest.raises(ValueError, match="unknown scope"):
        token_create(tenant=tenant, user=user, name="x", scopes=["jobs:read", "admin:all"])
    with pytest.raises(ValueError, match="not a member of tenant tenant-b"):
        token_create(tenant=other_tenant, user=user, name="x")
    issued = token_create(tenant=tenant, user=user, name="x", expires_days=3)
    entry = AuditLog.objects.get(tenant=tenant, action="token.create")
    assert entry.target == issued.token.prefix and entry.after["name"] == "x"
    assert issued.plaintext not in str(entry.after)


def test_tenant_quota_and_suspend_commands(tenant):
    from accounts.limits import PLAN_DEFAULTS
    from accounts.models import Plan
    from accounts.selectors import limits_for

    Plan.objects.create(name="team", max_gpus_per_job=4, monthly_spend_limit="500.00")
    out = StringIO()
    call_command(
        "tenant_quota", tenant.slug, "--plan", "team", "--max-open-jobs", "20", "--on-budget-exhausted", "finish",
        stdout=out,
    )  # fmt: skip
    text = out.getvalue()
    assert "max_gpus_per_job: 4" in text and "max_open_jobs: 20" in text and "monthly_spend_limit: 500.00" in text
    assert "this month: 0.000 GPU-hours, spend 0.00" in text
    call_command("tenant_quota", tenant.slug, "--clear", "max_open_jobs", stdout=StringIO())
    assert limits_for(tenant).max_open_jobs == PLAN_DEFAULTS["max_open_jobs"]  # back to the built-in default
    with pytest.raises(CommandError, match="no plan 'gold'"):
        call_command("tenant_quota", tenant.slug, "--plan", "gold", stdout=StringIO())
    with pytest.raises(CommandError, match="between 1 and 100"):
        call_command("tenant_quota", tenant.slug, "--budget-alert-percent", "150", stdout=StringIO())
    assert AuditLog.objects.filter(tenant=tenant, action="quota.set").count() == 2

    with pytest.raises(CommandError, match="needs a reason"):
        call_command("tenant_suspend", tenant.slug, stdout=StringIO())
    out = StringIO()
    call_command("tenant_suspend", tenant.slug, "--reason", "unpaid", stdout=out)
    assert "is suspended" in out.getvalue()
    call_command("tenant_suspend", tenant.slug, "--reinstate", stdout=out)
    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.ACTIVE
