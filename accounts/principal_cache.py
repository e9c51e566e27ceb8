"""A short-lived cache of verified API-token principals, invalidated on the very next request.

Checking a token costs two queries (token with its tenant and user; the
membership) on every request. This keeps the verified principal in the web
process for up to ``TTL_S`` and, on every request, checks one **version key**
per token in Redis (one script call, ~0.1 ms, that also counts the request's rate
limits: ``gpushare.throttling``). Whatever may change the outcome
of a check bumps the version of every token it affects:

- revoking a token, editing or deleting it;
- removing a member or changing their role (their tokens in that tenant);
- saving or deleting a user (deactivation, ``is_active=False``): all their tokens;
- saving a tenant (suspension, reinstatement): all its tokens.

The bumps are wired to the models' ``post_save`` / ``post_delete`` signals in
:mod:`accounts.apps` (so the admin, the shell and every service are covered)
and :func:`tokens_bump` is also called by services that write with
``QuerySet.update()``, which sends no signal. A bump happens at once and again
after the transaction commits. Expiry needs no bump: ``expires_at`` is checked
against the clock on every hit.

Why it is safe: the version is read **before** the database is, and stored
with the principal built from that read; a change commits and then bumps, so
a principal read before the commit carries a version older than the bump and
is never reused after it. A missing key (never set, or Redis lost it) is set
to a fresh random value before the database read, so a principal is never
cached against "no version". Without Redis (the embedded demo), or when
Redis does not answer, nothing is cached: every request reads the database.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import redis
from django.conf import settings
from django.db import transaction

from gpushare.ratelimit import GCRA_FUNCTION, script_run

log = logging.getLogger(__name__)

TTL_S = 30.0  # a principal is reused at most this long, whatever the versions say
MAX_ENTRIES = 10_000
KEY_PREFIX = "gpushare:auth:v:"
KEY_TTL_S = 7 * 24 * 3600  # an idle token's version may be forgotten: it is then re-created, which misses


@dataclass(frozen=True)
class Entry:
    user: object
    principal: object
    version: bytes
    until: float  # time.monotonic() after which the entry is not used


_entries: OrderedDict[str, Entry] = OrderedDict()
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _redis():
    url = getattr(settings, "REDIS_URL", "")
    if not url.startswith(("redis://", "rediss://")):
        return None
    return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)


def enabled() -> bool:
    return _redis() is not None


def _key(digest: str) -> str:
    return KEY_PREFIX + digest


# The token's version (created if missing) and, in the same round trip, the request's rate limits.
# KEYS[1] the version key, KEYS[2..] rate-limit keys; ARGV[1] a fresh version, ARGV[2] its TTL (s),
# then an interval and a burst (µs) per rate-limit key. Answers {version, wait ms per rate key}.
CHECK = (
    GCRA_FUNCTION
    + """
local version = redis.call('GET', KEYS[1])
if not version then
  version = ARGV[1]
  redis.call('SET', KEYS[1], version, 'EX', ARGV[2])
end
local answer = {version}
if #KEYS > 1 then
  local now = now_us()
  for i = 2, #KEYS do
    answer[i] = gcra(KEYS[i], tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i]), now)
  end
end
return answer
"""
)


_versions_made = itertools.count()
_process_nonce = [secrets.token_hex(8)]
os.register_at_fork(after_in_child=lambda: _process_nonce.__setitem__(0, secrets.token_hex(8)))


def _fresh_version() -> str:
    """A version no token ever had: a random nonce of this process's (drawn again in every forked child) and
    a counter. Built on every request, used only when the key is missing: ``secrets.token_hex`` is a
    ``getrandom`` system call."""
    return f"{_process_nonce[0]}-{next(_versions_made)}"


@lru_cache(maxsize=1)
def _check_script(client):
    return client.register_script(CHECK)


RatePlan = tuple[str, int, int]  # a rate limit's key, interval and burst (µs): gpushare.ratelimit


class Lookup(NamedTuple):
    entry: Entry | None  # the cached check, still valid
    version: bytes | None  # the token's current version (None: Redis did not answer, cache nothing)
    rate_waits: dict[str, int]  # per rate-limit key counted with it: 0 allowed, else ms to wait


NOTHING = Lookup(None, None, {})


def lookup(digest: str, rates: Callable[[object], list[RatePlan]] | None = None) -> Lookup:
    """The cached entry if it is still valid, the token's current version (read from Redis before
    any database read the caller makes on a miss) and, when ``rates`` is given and the token has a
    cached principal, the rate limits ``rates(principal)`` names, counted in the same round trip.

    The limits are counted before the version says whether the principal still holds: a refused
    token has spent one request of its allowance, as any request does.
    """
    client = _redis()
    if client is None:
        return NOTHING
    entry = _entries.get(digest)
    plans = rates(entry.principal) if rates is not None and entry is not None else []
    args: list = [_fresh_version(), KEY_TTL_S]
    for _, interval, burst in plans:
        args += [interval, burst]
    try:
        answer = script_run(client, _check_script(client), [_key(digest), *(key for key, _, _ in plans)], args)
    except redis.RedisError:
        log.warning("auth cache: Redis did not answer; checking tokens in the database", exc_info=True)
        return NOTHING
    version = answer[0]
    waits = {key: int(wait) for (key, _, _), wait in zip(plans, answer[1:], strict=True)}
    if entry is not None and entry.version == version and entry.until > time.monotonic():
        return Lookup(entry, version, waits)
    if entry is not None:
        with _lock:
            _entries.pop(digest, None)
    return Lookup(None, version, waits)


def store(digest: str, *, user, principal, version: bytes) -> None:
    with _lock:
        _entries[digest] = Entry(user=user, principal=principal, version=version, until=time.monotonic() + TTL_S)
        _entries.move_to_end(digest)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)


def forget(digest: str) -> None:
    with _lock:
        _entries.pop(digest, None)


def clear() -> None:
    """Drop this process's entries (tests)."""
    with _lock:
        _entries.clear()


def _bump_now(digests: list[str]) -> None:
    client = _redis()
    if client is None or not digests:
        return
    try:
        with client.pipeline(transaction=False) as pipe:
            for digest in digests:
                pipe.set(_key(digest), secrets.token_hex(8), ex=KEY_TTL_S)
            pipe.execute()
    except redis.RedisError:
        # Other processes keep a stale principal for at most TTL_S.
        log.error(
            "auth cache: could not invalidate %d token(s); cached checks expire within %.0f s", len(digests), TTL_S
        )


def tokens_bump(digests) -> None:
    """Invalidate the cached checks of these tokens (by hash) now and again after commit."""
    digests = sorted(set(digests))
    if not digests:
        return
    for digest in digests:
        forget(digest)
    _bump_now(digests)
    transaction.on_commit(lambda: (_bump_now(digests), [forget(d) for d in digests]))


def tokens_bump_where(**filters) -> None:
    """Invalidate the cached checks of every token matching ``filters`` (``user_id=``, ``tenant_id=``...)."""
    from django_scopes import scopes_disabled

    from .models import ApiToken

    if "tenant_id" in filters:
        from .tenancy import tenant_scope

        with tenant_scope(filters["tenant_id"]):
            tokens_bump(ApiToken.objects.filter(**filters).values_list("token_hash", flat=True))
        return
    with scopes_disabled():  # a user's tokens in every tenant they belong to
        tokens_bump(ApiToken.objects.filter(**filters).values_list("token_hash", flat=True))
