"""The cached token check (accounts.principal_cache): reused while nothing changed, refused on the
very next request once the token is revoked or expired, its user removed, demoted or deactivated."""

from __future__ import annotations

import subprocess
import sys
import time
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


def assert_trusted(plaintext: str) -> None:
    """The check is reused with no round trip to Redis: the key watch vouches for it."""
    entry = principal_cache._entries[token_hash(plaintext)]
    watch = principal_cache._watch(principal_cache._redis())
    assert entry.epoch is not None and entry.epoch == watch.epoch


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
    assert_trusted(issued.plaintext)
    token_revoke(token=issued.token, actor=None)
    assert_refused(client, "revoked")


def test_token_revoked_with_a_bare_update_and_a_bump(issued):
    """Code that writes with QuerySet.update() (no signal) calls tokens_bump; then it holds too."""
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
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
    assert_trusted(issued.plaintext)
    with scopes_disabled():
        membership = Membership.objects.get(tenant=tenant, user=issued.token.user)
    member_remove(membership=membership, actor=issued.token.user)  # leaving
    assert_refused(client, "revoked")  # member_remove revokes the member's tokens


def test_membership_deleted_in_the_admin_is_refused_on_the_next_request(issued, tenant):
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
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
    assert_trusted(issued.plaintext)
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
    assert_trusted(issued.plaintext)  # the revocation reaches it through the key watch alone
    subprocess.run(
        [sys.executable, "-c", REVOKE_ELSEWHERE.format(pk=issued.token.pk)],
        cwd=ROOT,
        env=process_env(),
        check=True,
        timeout=60,
    )
    assert_refused(client, "revoked")


def redis_commands(monkeypatch) -> list:
    """Every command any redis-py client of this process sends from now on (all go through send_command)."""
    import redis

    sent = []
    real = redis.connection.AbstractConnection.send_command
    monkeypatch.setattr(
        redis.connection.AbstractConnection,
        "send_command",
        lambda self, *args, **kw: sent.append(args[0]) or real(self, *args, **kw),
    )
    return sent


def redis_cache(settings, issued) -> None:
    """The throttles' counters in Redis, this tenant's counted from zero (a test database's ids repeat)."""
    principal_cache._redis().delete(f"throttle:tenant:{issued.token.tenant_id}")
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": settings.REDIS_URL}
    }


def test_warm_requests_ask_redis_nothing_and_every_request_is_counted(issued, monkeypatch, settings):
    """A trusted check and leased rate limits: most warm requests make no round trip at all, and every
    request let through was counted in Redis, on the token's limit and on the tenant's."""
    from accounts.services import quota_set
    from gpushare.throttling import _gcra_of

    redis_cache(settings, issued)
    quota_set(tenant=issued.token.tenant, actor=None, api_requests_per_minute=6000)
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
    server = principal_cache._redis()
    started_us = int(server.time()[0]) * 1_000_000 + int(server.time()[1])
    sent = redis_commands(monkeypatch)
    for _ in range(200):
        assert client.get("/api/v1/").status_code == 200
    assert set(sent) <= {"EVALSHA"}
    # Leases double up to 1/32 of the burst (600/min -> 18, 6000/min -> 187): ~17 round trips for 200 requests
    # when they run quickly; a slow machine lets a lease end with requests left, halving the next. Either way
    # far fewer than one per request.
    assert 0 < len(sent) <= 40
    sent.clear()
    assert client.get("/api/v1/").status_code == 200
    assert sent == []
    limits = {
        f"throttle:token:token:{issued.token.prefix}": _gcra_of(
            settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["token"]
        ),
        f"throttle:tenant:{issued.token.tenant_id}": _gcra_of("6000/min"),
    }
    for key, (interval, _) in limits.items():  # each request let through moved the key's TAT one interval on
        counted = (int(server.get(key)) - started_us) // interval
        assert counted >= 201, key


def test_leased_requests_never_exceed_the_limit(issued, settings, monkeypatch):
    """Leases are counted in Redis when granted: a client gets exactly its allowance, then 429."""
    redis_cache(settings, issued)
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "tenant": "320/day"},
    }
    client = client_with(issued.plaintext)
    sent = redis_commands(monkeypatch)
    answers = [client.get("/api/v1/").status_code for _ in range(330)]
    assert answers.count(200) == 320 and answers[:320] == [200] * 320, answers
    assert set(answers[320:]) == {429}
    assert len(sent) < 330 // 3  # the limits were leased, not counted request by request


def test_a_request_after_a_quiet_spell_is_answered_before_its_lease_is_renewed(issued, monkeypatch, settings):
    """A lease that ended with requests left (the client went quiet) lends the next request one of them,
    counted in Redis already: no round trip before the answer. Its renewal (the rest handed back, a new
    lease taken) waits for the response to be sent."""
    from gpushare import after_response

    redis_cache(settings, issued)
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
    digest = token_hash(issued.plaintext)
    principal_cache.lookup(digest, lambda principal: PLANS)  # leases of these limits, granted
    now = time.monotonic()
    for key in KEYS:  # the client went quiet: every lease ended with requests left
        principal_cache._leases[key].left, principal_cache._leases[key].until = 5, now - 0.5
    sent = redis_commands(monkeypatch)
    after_response._local.pending = []  # inside a request, as AfterResponseMiddleware opens it
    try:
        found = principal_cache.lookup(digest, lambda principal: PLANS)
        assert found.entry is not None and found.rate_waits == dict.fromkeys(KEYS, 0)
        assert sent == []  # let through on the ended leases: nothing asked before the answer
        assert len(after_response._local.pending) == 1
    finally:
        after_response._run_pending()  # the response is sent: the renewal runs
    assert sent == ["EVALSHA"]
    for key in KEYS:
        lease = principal_cache._leases[key]
        assert lease.until > time.monotonic() and lease.left >= 1  # a new lease; the request took none of it


def test_a_lease_that_ran_out_is_renewed_before_the_answer(issued, monkeypatch, settings):
    redis_cache(settings, issued)
    client = client_with(issued.plaintext)
    warm(client)
    digest = token_hash(issued.plaintext)
    principal_cache.lookup(digest, lambda principal: PLANS)
    now = time.monotonic()
    for key in KEYS:  # spent: near the limit, nothing to lend
        principal_cache._leases[key].left, principal_cache._leases[key].until = 0, now - 0.5
    sent = redis_commands(monkeypatch)
    from gpushare import after_response

    after_response._local.pending = []
    try:
        principal_cache.lookup(digest, lambda principal: PLANS)
        assert sent == ["EVALSHA"] and after_response._local.pending == []
    finally:
        after_response._run_pending()


def test_requests_let_through_on_ended_leases_never_exceed_the_limit(issued, settings, monkeypatch):
    """Every third request finds its leases ended: it is let through on what they had left, and the client
    still gets exactly its allowance, then 429."""
    redis_cache(settings, issued)
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "tenant": "320/day"},
    }
    client = client_with(issued.plaintext)
    lent = []
    real = principal_cache._renew_later
    monkeypatch.setattr(principal_cache, "_renew_later", lambda *a: lent.append(1) or real(*a))
    answers = []
    for n in range(330):
        if n % 3 == 0:  # the client went quiet for a while
            for lease in principal_cache._leases.values():
                lease.until = min(lease.until, time.monotonic() - 0.001)
        answers.append(client.get("/api/v1/").status_code)
    assert answers.count(200) == 320 and answers[:320] == [200] * 320, answers
    assert set(answers[320:]) == {429}
    assert len(lent) > 10  # the ended leases did lend


PLANS = [("throttle:test:a", 1_000_000, 60_000_000), ("throttle:test:b", 1_000_000, 60_000_000)]
KEYS = [key for key, _, _ in PLANS]
QUIET = [("throttle:test:quiet", 10_000, 60_000_000)]  # a burst of 6,000: a lease may hold more than one


def test_a_quiet_clients_calls_are_answered_before_their_leases_are_renewed(issued, monkeypatch, settings):
    """A client calling every few seconds finds its lease ended at each call. The renewal made before its
    first answer takes one request more than that answer needs, so each later call is lent the one kept
    and renews after its response: no round trip before any answer but the first (session 29)."""
    from gpushare import after_response

    redis_cache(settings, issued)
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
    digest = token_hash(issued.plaintext)
    principal_cache._redis().delete(QUIET[0][0])
    sent = redis_commands(monkeypatch)
    for call in range(3):
        for lease in principal_cache._leases.values():  # quiet for longer than a lease lives
            lease.until = min(lease.until, time.monotonic() - 0.001)
        sent.clear()
        after_response._local.pending = []  # inside a request, as AfterResponseMiddleware opens it
        try:
            found = principal_cache.lookup(digest, lambda principal: QUIET)
            assert found.entry is not None and found.rate_waits == {QUIET[0][0]: 0}
            assert bool(sent) == (call == 0), (call, sent)  # asked before the answer: the first call only
        finally:
            after_response._run_pending()


def test_a_version_changed_by_another_client_reaches_a_trusted_check_through_the_watch(issued, settings):
    """Nothing in this process forgets the check: only Redis's notice does, before the next request uses it."""
    import redis

    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
    other = redis.Redis.from_url(settings.REDIS_URL)  # another process's connection
    other.set(principal_cache._key(token_hash(issued.plaintext)), "bumped-elsewhere")
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/jobs/").status_code == 200
    assert auth_queries(queries.captured_queries)  # read again from the database


def test_a_change_during_a_database_read_is_not_trusted(issued):
    """A notice that arrives between the version read and the database read's end: the check is kept, but
    its version is read again on the next request (it may have been read before the change committed)."""
    digest = token_hash(issued.plaintext)
    found = principal_cache.lookup(digest)
    assert found.entry is None and found.version is not None
    principal_cache._redis().set(principal_cache._key(digest), "changed-elsewhere")
    principal_cache.store(digest, user=None, principal=None, version=found.version, seen=found.seen)
    assert principal_cache._entries[digest].epoch is None
    assert principal_cache.lookup(digest).entry is None  # the version moved on: not reused


def test_a_lost_key_watch_falls_back_to_asking_redis(issued, settings, monkeypatch):
    """The server drops the watch's connection: every cached check is forgotten and read again, and
    reused only with a version read until the watch is back."""
    import redis

    from gpushare import keywatch

    monkeypatch.setattr(keywatch, "RETRY_S", 0.0)
    client = client_with(issued.plaintext)
    warm(client)
    assert_trusted(issued.plaintext)
    killer = redis.Redis.from_url(settings.REDIS_URL)
    watching = [c for c in killer.client_list() if "t" in c["flags"] and "BCAST" not in c["flags"]]
    assert watching
    for conn in watching:
        killer.client_kill_filter(_id=conn["id"])
    sent = redis_commands(monkeypatch)
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/v1/jobs/").status_code == 200
    assert auth_queries(queries.captured_queries)  # forgotten: read again
    assert "EVALSHA" in sent
    for _ in range(3):  # the watch dials again, answers its PING, and the check is trusted again
        assert client.get("/api/v1/jobs/").status_code == 200
    assert_trusted(issued.plaintext)


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


def test_ended_leases_are_dropped_past_the_bound(monkeypatch):
    """One lease per token and tenant seen: past the bound, the ended ones go (a live one stays)."""
    monkeypatch.setattr(principal_cache, "MAX_ENTRIES", 2)
    principal_cache.clear()
    now = 1000.0
    for n in range(6):
        principal_cache._leases[f"ended:{n}"] = principal_cache.Lease(plan=(1, 1), left=3, until=now - 1, size=4)
    principal_cache._leases_grant([principal_cache.Renewal("live", 1, 1, 1, 0)], [1, 0], now)
    assert list(principal_cache._leases) == ["live"]
    principal_cache.clear()
