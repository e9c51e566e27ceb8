"""A short-lived cache of verified API-token principals, invalidated on the very next request.

Checking a token costs two queries (token with its tenant and user; the
membership) on every request. This keeps the verified principal in the web
process for up to ``TTL_S`` behind one **version key** per token in Redis.
A warm request reads nothing from Redis: this process's key watch
(``gpushare.keywatch``) is told of every change of a version key and drops the
check at once, and the request's rate limits are spent from leases (below). When
the watch is not live, or a lease has run out, one script call (~0.1 ms) reads the
version and renews the leases (``gpushare.throttling``). A lease that ended with
requests left (its client went quiet) lends the next request one of them and is
renewed after the response: a request after an idle second makes no round trip.
Whatever may change the outcome of a check bumps the version of every token it
affects:

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

Why skipping the read is safe too: a check is trusted without it only while
the watch is live (a PING sent within the last 3 s was answered, so every notice
Redis sent before it has arrived and been applied) and only if no notice came
between the version read it was stored with and its storing; a bump's notice is
applied by the very poll that starts the next request. Anything else (the watch
lost, silent, just started, or a notice in that window) and the version is read.
"""

from __future__ import annotations

import dataclasses
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

from gpushare.after_response import after_response
from gpushare.keywatch import KeyWatch, watch_for
from gpushare.ratelimit import GCRA_FUNCTION, script_run

log = logging.getLogger(__name__)

TTL_S = 30.0  # a principal is reused at most this long, whatever the versions say
MAX_ENTRIES = 10_000
KEY_PREFIX = "gpushare:auth:v:"
KEY_PREFIX_BYTES = KEY_PREFIX.encode()
LEASE_S = 1.0  # a rate-limit lease's life: what is left then is handed back
LEASE_SHARE = 32  # a lease holds at most this fraction of a limit's burst (and at least one request)
KEY_TTL_S = 7 * 24 * 3600  # an idle token's version may be forgotten: it is then re-created, which misses


@dataclass(frozen=True)
class Entry:
    user: object
    principal: object
    version: bytes
    until: float  # time.monotonic() after which the entry is not used
    epoch: int | None = None  # the key watch's link it is trusted under; None: its version is read every time


@dataclass
class Lease:
    """Requests of one rate limit this process may let through without asking Redis (already counted there)."""

    plan: tuple[int, int]  # the limit's (interval, burst) in µs: another rate is another lease
    left: int
    until: float  # time.monotonic(): unused cells after this are handed back
    size: int  # requests granted last time: the next renewal asks for twice, half or as many


_entries: OrderedDict[str, Entry] = OrderedDict()
_leases: dict[str, Lease] = {}
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _redis():
    url = getattr(settings, "REDIS_URL", "")
    if not url.startswith(("redis://", "rediss://")):
        return None
    return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)


def _changed(keys) -> None:
    """The key watch's notice: these version keys changed (None: Redis forgot everything)."""
    with _lock:
        if keys is None:
            _entries.clear()
            _leases.clear()
            return
        for key in keys:
            if key.startswith(KEY_PREFIX_BYTES):
                _entries.pop(key[len(KEY_PREFIX_BYTES) :].decode(), None)


@lru_cache(maxsize=1)
def _watch(client) -> KeyWatch | None:
    """This process's watch on the version keys, on the server ``client`` talks to, kept live while the
    process is quiet (``KeyWatch.keep``): a client calling every few seconds is trusted without a round trip."""
    watch = watch_for(client, prefix=KEY_PREFIX, on_change=_changed)
    if watch is not None:
        watch.keep()
    return watch


def enabled() -> bool:
    return _redis() is not None


def _key(digest: str) -> str:
    return KEY_PREFIX + digest


# The token's version (created if missing) and, in the same round trip, leases on the request's rate limits.
# KEYS[1] the version key, KEYS[2..] rate-limit keys; ARGV[1] a fresh version, ARGV[2] its TTL (s), then
# four numbers per rate-limit key: interval and burst (µs), the requests wanted, the requests handed back.
# Answers {version, then granted and wait ms per rate key}.
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
    local at = 4 * i - 5
    local granted, wait = gcra_lease(KEYS[i], tonumber(ARGV[at]), tonumber(ARGV[at + 1]), now,
                                     tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]))
    answer[2 * i - 2] = granted
    answer[2 * i - 1] = wait
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


class Renewal(NamedTuple):
    """A lease to renew: its limit, the requests wanted and handed back; ``served``: the request that asks
    was let through already (on what the ended lease had left), so it takes none of the new one."""

    key: str
    interval: int
    burst: int
    want: int
    back: int
    served: bool = False


class Lookup(NamedTuple):
    entry: Entry | None  # the cached check, still valid
    version: bytes | None  # the token's current version (None: Redis did not answer, cache nothing)
    rate_waits: dict[str, int]  # per rate-limit key counted with it: 0 allowed, else ms to wait
    seen: int | None = None  # the key watch's count of notices before Redis was read (``store`` compares)


NOTHING = Lookup(None, None, {})


def lookup(digest: str, rates: Callable[[object], list[RatePlan]] | None = None) -> Lookup:
    """The cached entry if it is still valid, the token's current version (read from Redis before
    any database read the caller makes on a miss) and, when ``rates`` is given and the token has a
    cached principal, the rate limits ``rates(principal)`` names, counted before the answer.

    **No round trip** when the entry is trusted under the live key watch (no notice has named the
    token since it was stored: ``gpushare.keywatch``) and every limit has a request left in this
    process's lease, live or ended (an ended one is renewed after the response: ``_leases_take``).
    Otherwise one round trip reads the version and renews the leases that ran out.

    The limits are counted before the version says whether the principal still holds: a refused
    token has spent one request of its allowance, as any request does.
    """
    client = _redis()
    if client is None:
        return NOTHING
    watch = _watch(client)
    live = watch is not None and watch.poll()
    seen = watch.seen if watch is not None else None
    now = time.monotonic()
    entry = _entries.get(digest)
    if entry is not None and entry.until <= now:
        forget(digest)
        entry = None
    plans = rates(entry.principal) if rates is not None and entry is not None else []
    waits, renew, later = _leases_take(plans, now)
    if live and not renew and entry is not None and entry.epoch == watch.epoch:
        if later:
            after_response(lambda: _renew_later(digest, later))
        return Lookup(entry, entry.version, waits, seen)
    renew += later  # a round trip now anyway: the ended leases are renewed with it
    try:
        answer = _check_run(client, digest, renew)
    except redis.RedisError:
        log.warning("auth cache: Redis did not answer; checking tokens in the database", exc_info=True)
        return NOTHING
    version = answer[0]
    waits.update(_leases_grant(renew, answer[1:], time.monotonic()))
    if entry is None or entry.version != version:
        if entry is not None:
            forget(digest)
        return Lookup(None, version, waits, seen)
    if live and entry.epoch != watch.epoch and watch.poll() and watch.seen == seen:
        entry = _trusted(digest, entry, watch.epoch)  # nothing changed while Redis was asked
    return Lookup(entry, version, waits, seen)


def _check_run(client, digest: str, renew: list[Renewal]) -> list:
    """One call of ``CHECK``: the token's version (made if missing), then (granted, wait) per renewal."""
    args: list = [_fresh_version(), KEY_TTL_S]
    for renewal in renew:
        args += [renewal.interval, renewal.burst, renewal.want, renewal.back]
    return script_run(client, _check_script(client), [_key(digest), *(r.key for r in renew)], args)


def store(digest: str, *, user, principal, version: bytes, seen: int | None = None) -> None:
    """Keep a check made from the database after ``lookup`` read ``version``. Trusted without a round
    trip only when the key watch is live and has had no notice since that read (``seen``): a change
    committed meanwhile would have sent one."""
    epoch = None
    client = _redis()
    watch = _watch(client) if client is not None else None
    if watch is not None and seen is not None and watch.poll() and watch.seen == seen:
        epoch = watch.epoch
    entry = Entry(user=user, principal=principal, version=version, until=time.monotonic() + TTL_S, epoch=epoch)
    with _lock:
        _entries[digest] = entry
        _entries.move_to_end(digest)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)


def _trusted(digest: str, entry: Entry, epoch: int) -> Entry:
    trusted = dataclasses.replace(entry, epoch=epoch)
    with _lock:
        if _entries.get(digest) is entry:
            _entries[digest] = trusted
    return trusted


# --- rate-limit leases -------------------------------------------------------------------------------
# A process asks Redis for several requests of a limit at once (counted there at once, so the limit is
# never exceeded) and lets them through one by one. A lease lives LEASE_S; what is left then is handed
# back with the next renewal. Its size doubles while leases run out before they end and halves when they
# do not, up to 1/LEASE_SHARE of the limit's burst: a small limit (under LEASE_SHARE requests of burst)
# is counted in Redis request by request. What the leasing costs a client: other processes' unspent
# leases, at most 1/LEASE_SHARE of its burst each for at most LEASE_S, may be refused to it meanwhile.


def _lease_cap(interval: int, burst: int) -> int:
    return max(1, (burst // interval + 1) // LEASE_SHARE)


def _leases_take(plans: list[RatePlan], now: float) -> tuple[dict[str, int], list[Renewal], list[Renewal]]:
    """Each plan's request from its lease where one is left ({key: 0}); the renewals the others need before
    the request is answered; and the renewals that can wait until after the response.

    A lease that ended with requests left (its client went quiet) lends this request one of them: they are
    counted in Redis already, so the limit holds, and the request needs no round trip. The rest is handed
    back, and a new lease asked for, after the response. A lease that ran out, or never was, is renewed first.
    """
    waits: dict[str, int] = {}
    renew: list[Renewal] = []
    later: list[Renewal] = []
    if not plans:
        return waits, renew, later
    with _lock:
        for key, interval, burst in plans:
            lease = _leases.get(key)
            if lease is not None and lease.plan == (interval, burst) and lease.left and lease.until > now:
                lease.left -= 1
                waits[key] = 0
                continue
            if lease is None or lease.plan != (interval, burst):
                want, back = min(_lease_cap(interval, burst), 2), 0  # one for this request, one kept (below)
            elif lease.left:  # ended with requests left: this request takes one, the rest go back, ask for fewer
                waits[key] = 0
                want = max(1, lease.size // 2)
                later.append(Renewal(key, interval, burst, want, lease.left - 1, served=True))
                _leases[key] = Lease(plan=(interval, burst), left=0, until=0.0, size=want)
                continue
            elif lease.until > now:  # ran out before it ended: ask for more
                want, back = min(_lease_cap(interval, burst), lease.size * 2), 0
            else:  # ended, spent: a quiet client's next request. One more than it takes, if the limit allows,
                # so that the request after it is lent that one and renews after its response, not before
                want, back = min(_lease_cap(interval, burst), max(2, lease.size)), 0
            _leases[key] = Lease(plan=(interval, burst), left=0, until=0.0, size=want)  # handed back once
            renew.append(Renewal(key, interval, burst, want, back))
    return waits, renew, later


def _leases_grant(renew: list[Renewal], answers: list, now: float) -> dict[str, int]:
    """The renewals' answers (granted, wait) per key: a request not served yet takes one granted request
    (its wait is answered), the lease keeps the rest."""
    waits = {}
    with _lock:
        for renewal, granted, wait in zip(renew, answers[::2], answers[1::2], strict=True):
            key, interval, burst, want = renewal.key, renewal.interval, renewal.burst, renewal.want
            granted = int(granted)
            taken = 0 if renewal.served else 1
            if not renewal.served:
                waits[key] = 0 if granted else int(wait)
            lease = _leases.get(key)
            if lease is None or lease.plan != (interval, burst):
                lease = _leases[key] = Lease(plan=(interval, burst), left=0, until=0.0, size=want)
            lease.left += max(0, granted - taken)
            lease.until = now + LEASE_S
            lease.size = max(1, granted)  # near the limit Redis grants fewer: grow from there
        if len(_leases) > MAX_ENTRIES * 2:  # one per token and tenant seen: drop the ended ones (unspent ones lost)
            for ended in [key for key, lease in _leases.items() if lease.until <= now]:
                del _leases[ended]
    return waits


def _renew_later(digest: str, later: list[Renewal]) -> None:
    """After the response: hand back what the ended leases had left and take new ones (one round trip, as
    ``lookup`` makes). The token's version comes back with them: a change seen drops its cached check."""
    try:
        answer = _check_run(_redis(), digest, later)
    except redis.RedisError:
        log.warning("rate limits: Redis did not answer a renewal; the next request renews", exc_info=True)
        return
    _leases_grant(later, answer[1:], time.monotonic())
    entry = _entries.get(digest)
    if entry is not None and entry.version != answer[0]:
        forget(digest)


def forget(digest: str) -> None:
    with _lock:
        _entries.pop(digest, None)


def clear() -> None:
    """Drop this process's entries and leases (tests)."""
    with _lock:
        _entries.clear()
        _leases.clear()


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
