"""Rate limiting per API token (429 with Retry-After; see gpushare/api.py for the error shape).

Kept apart from gpushare/api.py because DRF imports throttle classes while
``rest_framework.views`` itself is being imported.
"""

from __future__ import annotations

from rest_framework import throttling
from rest_framework.settings import api_settings

from accounts.authentication import TokenPrincipal


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
        self.rate = self.get_rate()
        if self.rate is None:
            return True
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

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
        return max(1, int(-(-(super().wait() or 1) // 1)))
