"""Rate limiting per API token and per tenant (429 with Retry-After; see gpushare/api.py for the error shape).

Two throttles, both counted in Redis (the default cache) so every web process shares them:
``TokenRateThrottle`` (each token, the platform's ``GPUSHARE_API_RATE``) and
``TenantRateThrottle`` (the whole tenant, its plan's ``api_requests_per_minute``: minting more
tokens or running more web processes does not raise it).

Kept apart from gpushare/api.py because DRF imports throttle classes while
``rest_framework.views`` itself is being imported.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import redis
from django.conf import settings
from rest_framework import throttling
from rest_framework.settings import api_settings

from accounts.authentication import TokenPrincipal

log = logging.getLogger(__name__)

# GCRA (the generic cell rate algorithm) in one atomic round trip: one key per client holding its
# "theoretical arrival time"; N requests may come at once, then one per duration/N. Redis's own
# clock, so every web process agrees. Times in microseconds; returns 0 (allowed) or the milliseconds
# to wait.
GCRA = """
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
if tat - now > burst then return math.ceil((tat - now - burst) / 1000) end
local ttl = math.ceil((tat + interval - now) / 1000) + 1000
redis.call('SET', KEYS[1], string.format('%d', tat + interval), 'PX', ttl)
return 0
"""


@lru_cache(maxsize=4)
def _gcra_script(location: str):
    return redis.Redis.from_url(location, socket_timeout=1, socket_connect_timeout=1).register_script(GCRA)


def _redis_location() -> str | None:
    cache = settings.CACHES.get("default", {})
    if cache.get("BACKEND", "").endswith("RedisCache"):
        location = cache.get("LOCATION")
        return location[0] if isinstance(location, list | tuple) else location
    return None


def rate_text() -> str:
    rate = api_settings.DEFAULT_THROTTLE_RATES.get(TokenRateThrottle.scope) or ""
    return f"limit {rate}" if rate else "rate limit"


class TokenRateThrottle(throttling.SimpleRateThrottle):
    """Rate limit per API token (per user for a browser session, per address otherwise).

    The rate is ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["token"]``, read on
    each request (so tests can change it); the counters live in the default
    cache (Redis when REDIS_URL is set), so every web process shares them.
    """

    scope = "token"

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def allow_request(self, request, view):
        """One Redis round trip (GCRA, above) when the cache is Redis; DRF's history list otherwise.

        DRF's own throttle reads the client's whole request history (a pickled list of up to N
        timestamps), trims it and writes it back: two round trips and O(N) work per request.
        """
        self.rate = self.get_rate()
        if self.rate is None:
            return True
        self.num_requests, self.duration = self.parse_rate(self.rate)
        location = _redis_location()
        if location is None:
            return super().allow_request(request, view)
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        interval_us = max(1, round(self.duration * 1_000_000 / self.num_requests))
        try:
            wait_ms = _gcra_script(location)(keys=[self.key], args=[interval_us, interval_us * (self.num_requests - 1)])
        except redis.RedisError:
            log.warning("rate limit: Redis did not answer; request allowed", exc_info=True)
            return True
        self._wait_s = float(wait_ms) / 1000
        return not wait_ms

    def get_cache_key(self, request, view):
        principal = request.auth
        if isinstance(principal, TokenPrincipal):
            ident = f"token:{principal.token.prefix}"
        elif request.user is not None and request.user.is_authenticated:
            ident = f"user:{request.user.pk}"
        else:
            ident = f"addr:{self.get_ident(request)}"
        return f"throttle:{self.scope}:{ident}"

    def wait(self):
        # Whole seconds, at least 1: what Retry-After says.
        seconds = getattr(self, "_wait_s", None)
        if seconds is None:
            seconds = super().wait() or 1
        return max(1, int(-(-seconds // 1)))


LIMIT_CACHE_S = 30  # a changed api_requests_per_minute applies within this long


def tenant_rate_limit(tenant_id: int) -> int | None:
    """The tenant's ``api_requests_per_minute`` (its quota, plan, the default plan, the built-in default),
    read through the cache so a request costs no query."""
    from django.core.cache import cache

    from accounts.models import Tenant
    from accounts.selectors import limits_for

    key = f"limits:api_rate:{tenant_id}"
    found = cache.get(key)
    if found is None:
        limit = limits_for(Tenant(pk=tenant_id)).api_requests_per_minute
        found = -1 if limit is None else limit
        cache.set(key, found, LIMIT_CACHE_S)
    return None if found < 0 else found


class TenantRateThrottle(TokenRateThrottle):
    """API requests per tenant per minute, across all its tokens and every web process (GCRA in Redis).

    Only requests made with a tenant token are counted here (a browser session has no tenant principal;
    the per-user throttle above covers it).
    """

    scope = "tenant"

    def allow_request(self, request, view):
        principal = request.auth
        self._tenant_id = principal.tenant.pk if isinstance(principal, TokenPrincipal) else None
        if self._tenant_id is None:
            return True
        self._override = api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)  # GPUSHARE_TENANT_API_RATE
        self._limit = None if self._override else tenant_rate_limit(self._tenant_id)
        allowed = super().allow_request(request, view)
        if not allowed:
            request._request.throttled_by_tenant = self._override or self._limit
        return allowed

    def get_rate(self):
        if getattr(self, "_override", None):
            return self._override
        limit = getattr(self, "_limit", None)
        return None if limit is None else f"{limit}/min"

    def get_cache_key(self, request, view):
        return f"throttle:tenant:{self._tenant_id}"
