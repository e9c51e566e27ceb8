"""The cached token check (accounts.principal_cache): reused while nothing changed, refused on the
very next request once the token is revoked or expired, its user removed, demoted or deactivated."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_scopes import scopes_disabled
from rest_framework.test import APIClient

from accounts import principal_cache
from accounts.models import ApiToken, Membership, Role
from accounts.services import member_remove, token_create, token_hash, token_revoke
from tests.factories import member_add
from tests.processes import ROOT, process_env

pytestmark = pytest.mark.skipif(not principal_cache.enabled(), reason="the principal cache needs Redis")


def client_with(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def auth_queries(queries) -> list[str]:
    return [q["sql"] for q in queries if "accounts_apitoken" in q["sql"] or "accounts_membership" in q["sql"]]


@pytest.fixture
def issued(db, tenant):
    principal_cache.clear()
    return token_create(tenant=tenant, user=member_add(tenant, role=Role.ADMIN), name="ci")


def warm(client) -> None:
    assert client.get("/api/v1/jobs/").status_code == 200
    assert client.get("/api/v1/jobs/").status_code == 200


def assert_refused(client, words: str) -> None:
    response = client.get("/api/v1/jobs/")
    assert response.status_code == 401, response.content
    assert words in response.json()["error"]["message"]


def test_a_warm_check_reads_no_token_or_membership_row(issued):
    client = client_with(issued.plaintext)
    warm(client)
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/jobs/").status_code == 200
    assert auth_queries(queries.captured_queries) == []
    assert token_hash(issued.plaintext) in principal_cache._entries


def test_revoked_token_is_refused_on_the_next_request(issued):
    client = client_with(issued.plaintext)
    warm(client)
    token_revoke(token=issued.token, actor=None)
    assert_refused(client, "revoked")


def test_token_revoked_with_a_bare_update_and_a_bump(issued):
    """Code that writes with QuerySet.update() (no signal) calls tokens_bump; then it holds too."""
    client = client_with(issued.plaintext)
    warm(client)
    with scopes_disabled():
        ApiToken.objects.filter(pk=issued.token.pk).update(revoked_at=timezone.now())
    principal_cache.tokens_bump_where(pk=issued.token.pk)
    assert_refused(client, "revoked")


def test_expired_token_is_refused_on_the_next_request(db, tenant, monkeypatch):
    principal_cache.clear()
    issued = token_create(tenant=tenant, user=member_add(tenant), name="short", expires_days=1)
    client = client_with(issued.plaintext)
    warm(client)
    later = timezone.now() + timedelta(days=1, seconds=1)
    monkeypatch.setattr("accounts.authentication.timezone.now", lambda: later)
    assert_refused(client, "expired")


def test_removed_member_is_refused_on_the_next_request(issued, tenant):
    client = client_with(issued.plaintext)
    warm(client)
    with scopes_disabled():
        membership = Membership.objects.get(tenant=tenant, user=issued.token.user)
    member_remove(membership=membership, actor=issued.token.user)  # leaving
    assert_refused(client, "revoked")  # member_remove revokes the member's tokens


def test_membership_deleted_in_the_admin_is_refused_on_the_next_request(issued, tenant):
    client = client_with(issued.plaintext)
    warm(client)
    with scopes_disabled():
        Membership.objects.filter(tenant=tenant, user=issued.token.user).delete()
    assert_refused(client, "no longer a member")


def test_demoted_member_loses_the_power_on_the_next_request(issued, tenant, rules):
    client = client_with(issued.plaintext)
    body = {"kind": "training", "gpus": 1, "command": ["true"]}
    assert client.post("/api/v1/jobs/", body, format="json").status_code == 201
    with scopes_disabled():
        membership = Membership.objects.get(tenant=tenant, user=issued.token.user)
        membership.role = Role.VIEWER
        membership.save()
    assert client.post("/api/v1/jobs/", body, format="json").status_code == 403


def test_inactive_user_is_refused_on_the_next_request(issued):
    client = client_with(issued.plaintext)
    warm(client)
    user = issued.token.user
    user.is_active = False
    user.save()
    assert_refused(client, "inactive")


def test_without_redis_nothing_is_cached(issued, monkeypatch):
    import redis

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    monkeypatch.setattr(principal_cache, "_redis", lambda: dead)
    client = client_with(issued.plaintext)
    warm(client)
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/jobs/").status_code == 200
    assert auth_queries(queries.captured_queries)  # every request checks the database
    token_revoke(token=issued.token, actor=None)
    assert_refused(client, "revoked")


REVOKE_ELSEWHERE = """
import django; django.setup()
from django_scopes import scopes_disabled
from accounts.models import ApiToken
from accounts.services import token_revoke
with scopes_disabled():
    token_revoke(token=ApiToken.objects.get(pk={pk}), actor=None)
"""


@pytest.mark.django_db(transaction=True)
def test_revocation_in_another_process_is_seen_on_the_next_request(tenant):
    """The cache is per process; the version key in Redis is what every web process checks."""
    principal_cache.clear()
    issued = token_create(tenant=tenant, user=member_add(tenant), name="ci")
    client = client_with(issued.plaintext)
    warm(client)
    subprocess.run(
        [sys.executable, "-c", REVOKE_ELSEWHERE.format(pk=issued.token.pk)],
        cwd=ROOT,
        env=process_env(),
        check=True,
        timeout=60,
    )
    assert_refused(client, "revoked")


def test_a_warm_request_checks_the_token_and_both_rate_limits_in_one_redis_round_trip(issued, monkeypatch, settings):
    """The version check carries the token's and the tenant's rate limits (gpushare.throttling): one
    command per request, not three; the limits are still counted once each."""
    import redis

    redis_cache = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": settings.REDIS_URL}
    settings.CACHES = {"default": redis_cache}

    from accounts.services import quota_set

    quota_set(tenant=issued.token.tenant, actor=None, api_requests_per_minute=1000)
    client = client_with(issued.plaintext)
    warm(client)
    sent = []
    real = redis.connection.AbstractConnection.send_command
    monkeypatch.setattr(
        redis.connection.AbstractConnection,
        "send_command",
        lambda self, *args, **kw: sent.append(args[0]) or real(self, *args, **kw),
    )
    assert client.get("/api/v1/").status_code == 200
    assert sent == ["EVALSHA"]  # every command any client sends goes through a connection's send_command
    keys = [f"throttle:token:token:{issued.token.prefix}", f"throttle:tenant:{issued.token.tenant_id}"]
    before = [principal_cache._redis().get(key) for key in keys]
    assert client.get("/api/v1/").status_code == 200
    after = [principal_cache._redis().get(key) for key in keys]
    assert all(a is not None and b is not None and int(a) > int(b) for a, b in zip(after, before, strict=True))


def test_the_check_survives_a_flushed_script_and_a_dropped_connection(issued, settings):
    """The check runs its script on a pooled connection directly (gpushare.ratelimit.script_run): a Redis
    that forgot the script (restarted, SCRIPT FLUSH) gets it again, and a pooled connection the server
    closed is replaced; the request is answered either way, still without reading the token's row."""
    import redis

    client = client_with(issued.plaintext)
    warm(client)
    server = principal_cache._redis()
    server.script_flush()
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/").status_code == 200
    assert auth_queries(queries.captured_queries) == []
    idle = list(server.connection_pool._available_connections)
    assert idle
    ids = []
    for conn in idle:
        conn.send_command("CLIENT", "ID")
        ids.append(conn.read_response())
    killer = redis.Redis.from_url(settings.REDIS_URL)
    for client_id in ids:  # the server drops every idle connection of the check's pool
        assert killer.client_kill_filter(_id=client_id) == 1
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/").status_code == 200
    assert auth_queries(queries.captured_queries) == []


def test_a_version_made_in_a_forked_process_is_not_its_parents():
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first fresh version, written to the parent
        os.write(write, principal_cache._fresh_version().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    theirs = os.read(read, 200).decode()
    mine = principal_cache._fresh_version()
    assert theirs.split("-")[0] != mine.split("-")[0]  # another nonce: counters restart, versions never repeat


def test_a_connection_the_server_closed_after_checkout_is_replaced_once(settings, monkeypatch):
    """gpushare.ratelimit.script_run: the pool checks a connection when it hands it out; one closed just
    after (a Redis restart, a proxy's idle timeout) fails its command, which is sent again on a new one."""
    import redis

    from gpushare.ratelimit import script_run

    client = redis.Redis.from_url(settings.REDIS_URL)
    script = client.register_script("return 7")
    pool, real, killed = client.connection_pool, client.connection_pool.get_connection, []

    def checkout(*args, **kwargs):
        conn = real(*args, **kwargs)
        if not killed:
            conn.send_command("CLIENT", "ID")
            killed.append(conn.read_response())
            assert redis.Redis.from_url(settings.REDIS_URL).client_kill_filter(_id=killed[0]) == 1
        return conn

    monkeypatch.setattr(pool, "get_connection", checkout)
    assert script_run(client, script, [], []) == 7
    assert killed
    monkeypatch.setattr(pool, "get_connection", real)
    assert script_run(client, script, [], []) == 7
