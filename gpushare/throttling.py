"""Rate limiting per API token and per tenant (429 with Retry-After; see gpushare/api.py for the error shape).

Two throttles, both counted in Redis (the default cache) so every web process shares them
(GCRA: gpushare/ratelimit.py):
``TokenRateThrottle`` (each token, the platform's ``GPUSHARE_API_RATE``) and
``TenantRateThrottle`` (the whole tenant, its plan's ``api_requests_per_minute``: minting more
tokens or running more web processes does not raise it).

Kept apart from gpushare/api.py because DRF imports throttle classes while
``rest_framework.views`` itself is being imported.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache

import redis
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from rest_framework import throttling
from rest_framework.settings import api_settings

from accounts import authentication
from accounts.authentication import TokenPrincipal
from gpushare.ratelimit import GCRA, gcra_args

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _gcra_script(location: str):
    return redis.Redis.from_url(location, socket_timeout=1, socket_connect_timeout=1).register_script(GCRA)


@lru_cache(maxsize=1)
def _redis_location() -> str | None:
    """Where the default cache's Redis is (None without one); read from the settings once (three reads a
    request cost ~8 us) and again after a test changes them."""
    cache = settings.CACHES.get("default", {})
    if cache.get("BACKEND", "").endswith("RedisCache"):
        location = cache.get("LOCATION")
        return location[0] if isinstance(location, list | tuple) else location
    return None


@receiver(setting_changed)
def _settings_changed(*, setting, **kwargs) -> None:
    if setting in ("CACHES", "REDIS_URL"):
        _redis_location.cache_clear()


@lru_cache(maxsize=64)
def _rate_parsed(rate: str) -> tuple[int, int]:
    return throttling.SimpleRateThrottle.parse_rate(None, rate)


@lru_cache(maxsize=64)
def _gcra_of(rate: str) -> tuple[int, int]:
    return gcra_args(*_rate_parsed(rate))


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

    def __init__(self):  # the rate is read per request (plan, allow_request): nothing to parse up front
        pass

    def parse_rate(self, rate):
        return (None, None) if rate is None else _rate_parsed(rate)

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def rate_for(self, principal) -> str | None:
        """The rate that applies to this request's principal ("N/period"), None when it is not limited."""
        return self.get_rate()

    def plan(self, request, principal) -> tuple[str, int, int] | None:
        """This request's GCRA check (key, interval, burst in µs), or None when it is not limited."""
        rate = self.rate_for(principal)
        if rate is None:
            return None
        return (self.key_for(request, principal), *_gcra_of(rate))

    def allow_request(self, request, view):
        """No Redis round trip of its own when the token check counted this limit with the token's
        version (``request.rate_waits``, :class:`BearerTokenAuthentication`); one (GCRA) otherwise.
        DRF's history list without Redis (the embedded demo)."""
        location = _redis_location()
        if location is None:
            self.rate = self.rate_for(request.auth)
            self.num_requests, self.duration = self.parse_rate(self.rate)
            return super().allow_request(request, view)
        plan = self.plan(request, request.auth)
        if plan is None:
            return True
        key, interval_us, burst_us = plan
        wait_ms = getattr(request._request, "rate_waits", {}).get(key)
        if wait_ms is None:
            try:
                wait_ms = _gcra_script(location)(keys=[key], args=[interval_us, burst_us])
            except redis.RedisError:
                log.warning("rate limit: Redis did not answer; request allowed", exc_info=True)
                return True
        self._wait_s = float(wait_ms) / 1000
        return not wait_ms

    def key_for(self, request, principal) -> str:
        if isinstance(principal, TokenPrincipal):
            ident = f"token:{principal.token.prefix}"
        elif request.user is not None and request.user.is_authenticated:
            ident = f"user:{request.user.pk}"
        else:
            ident = f"addr:{self.get_ident(request)}"
        return f"throttle:{self.scope}:{ident}"

    def get_cache_key(self, request, view):  # DRF's own path (no Redis)
        return self.key_for(request, request.auth)

    def wait(self):
        # Whole seconds, at least 1: what Retry-After says.
        seconds = getattr(self, "_wait_s", None)
        if seconds is None:
            seconds = super().wait() or 1
        return max(1, int(-(-seconds // 1)))


LIMIT_CACHE_S = 30  # a changed api_requests_per_minute applies within this long
_limits: dict[int, tuple[float, int | None]] = {}  # tenant -> (read at, limit); this process's


def tenant_rate_limit(tenant_id: int) -> int | None:
    """The tenant's ``api_requests_per_minute`` (its quota, plan, the default plan, the built-in default),
    kept in the process for ``LIMIT_CACHE_S`` so a request costs no query and no round trip."""
    from accounts.models import Tenant
    from accounts.selectors import limits_for

    now = time.monotonic()
    found = _limits.get(tenant_id)
    if found is None or now - found[0] > LIMIT_CACHE_S:
        found = (now, limits_for(Tenant(pk=tenant_id)).api_requests_per_minute)
        if len(_limits) > 10_000:
            _limits.clear()
        _limits[tenant_id] = found
    return found[1]


class TenantRateThrottle(TokenRateThrottle):
    """API requests per tenant per minute, across all its tokens and every web process (GCRA in Redis).

    Only requests made with a tenant token are counted here (a browser session has no tenant principal;
    the per-user throttle above covers it).
    """

    scope = "tenant"

    def limit_for(self, principal):
        """The tenant's allowance as the 429 names it: GPUSHARE_TENANT_API_RATE, else its per-minute limit."""
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope) or tenant_rate_limit(principal.tenant.pk)

    def rate_for(self, principal):
        if not isinstance(principal, TokenPrincipal):
            return None
        limit = self.limit_for(principal)
        return limit if limit is None or isinstance(limit, str) else f"{limit}/min"

    def allow_request(self, request, view):
        if not isinstance(request.auth, TokenPrincipal):
            return True
        allowed = super().allow_request(request, view)
        if not allowed:
            request._request.throttled_by_tenant = self.limit_for(request.auth)
        return allowed

    def key_for(self, request, principal):
        return f"throttle:tenant:{principal.tenant.pk}"


def rates_for_view(view, request):
    """What to count with the token check of ``request`` to ``view`` (``token_principal``'s ``rates``): the
    view's rate limits, when they live in the same Redis as the token versions; else None (each throttle
    then makes its own round trip)."""
    if view is None or _redis_location() != settings.REDIS_URL:
        return None
    throttles = [t for t in view.get_throttles() if isinstance(t, TokenRateThrottle)]
    if not throttles:
        return None
    return lambda principal: [plan for t in throttles if (plan := t.plan(request, principal)) is not None]


class BearerTokenAuthentication(authentication.BearerTokenAuthentication):
    """The API's bearer tokens: the view's rate limits are counted in the same Redis round trip as
    the token's version check (one round trip per request instead of three), and the throttles then
    read the answers. Only when the rate limits live in the same Redis as the token versions."""

    def rates(self, request):
        return rates_for_view((request.parser_context or {}).get("view"), request)
