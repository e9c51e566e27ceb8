"""The WSGI application: an API call made with a bearer token skips the browser's middleware.

``settings.MIDDLEWARE`` serves the browser: sessions, CSRF, the logged-in user, flash messages,
htmx, login lockouts (axes) and static files. A request to ``/api/`` that carries
``Authorization: Bearer ...`` (the SDK, the CLI, a CI pipeline) needs none of them: the token
alone says who calls (``accounts.authentication``; DRF tries it first and a bad token is a 401,
never a fall back to a session), a browser cannot send that header to another site without
asking first (CORS), so there is nothing for CSRF to guard, and ``/api/`` serves no static file.
Each of those layers still cost its call on every such request: ~0.1-0.2 ms of the ~1.2 ms of
CPU that ``GET /api/v1/`` took in-process on the bench machine (docs/benchmarks.md, Session 15).

So the process holds two Django handlers built from the one ordered list: the whole of it, and
the same without ``settings.BROWSER_ONLY_MIDDLEWARE``. Everything else a response gets is kept on
both: request id and log line, metrics, security headers and CSP, the API's body limit and error
shape, the calls kept for after the response. A request with no bearer token, or outside
``/api/``, takes the whole list, as before.

Both handlers keep what each path resolved to (``resolve_request``): Django walks the URL patterns on
every request, and an API path sits behind the admin's, the console's and each router's patterns with
their format-suffix twins (16-31 us of CPU per call for ``/api/v1/...`` on the bench machine, 5 us for a
first pattern).
"""

from __future__ import annotations

from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from django.urls import ResolverMatch, get_resolver

from .caches import LockedLRU

RESOLVED_KEPT = 4096  # paths whose match a process keeps, least recently used out first


def bearer_api(environ: dict) -> bool:
    """An ``/api/`` request that authenticates with a bearer token (the scheme is case-insensitive)."""
    return (
        environ.get("PATH_INFO", "").startswith("/api/")
        and environ.get("HTTP_AUTHORIZATION", "")[:7].lower() == "bearer "
    )


def api_middleware() -> list[str]:
    """``settings.MIDDLEWARE`` without the browser's: the bearer lane's, in the same order."""
    skipped = set(settings.BROWSER_ONLY_MIDDLEWARE)
    unknown = skipped.difference(settings.MIDDLEWARE)
    if unknown:  # a renamed or removed middleware left behind here would silently skip nothing
        raise ValueError(f"BROWSER_ONLY_MIDDLEWARE names middleware not in MIDDLEWARE: {sorted(unknown)}")
    return [name for name in settings.MIDDLEWARE if name not in skipped]


# (resolver, path) -> the ResolverMatch it gave. The resolver is in the key: settings that change the
# URLconf (tests) give a new one, so a match of the old one is never answered.
_resolved = LockedLRU(RESOLVED_KEPT)


class _Handler(WSGIHandler):
    """Django's WSGI handler, its chain built from ``middleware`` instead of ``settings.MIDDLEWARE``, its URL
    matches kept per path."""

    def __init__(self, middleware: list[str]):
        self._middleware_names = middleware
        super().__init__()

    def load_middleware(self, is_async=False):
        # Django reads the list from the settings; it is swapped for the build only (once, at start-up,
        # before the server hands this application any request).
        whole = settings.MIDDLEWARE
        settings.MIDDLEWARE = self._middleware_names
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = whole

    def resolve_request(self, request):
        """Django's, but a path resolved before is answered from ``_resolved``. A match depends on the path
        and the URLconf alone (no pattern here depends on the language or the host); a path that matches
        nothing raises ``Resolver404`` each time, and is not kept. Each request gets its own copy of the
        match, with its own ``kwargs``, which Django hands to middleware and the view."""
        if hasattr(request, "urlconf"):  # a URLconf set for this request by a middleware: as Django does
            return super().resolve_request(request)
        resolver = get_resolver()
        key = (resolver, request.path_info)
        kept = _resolved.get(key)
        if kept is None:
            kept = resolver.resolve(request.path_info)
            _resolved.put(key, kept)
        match = ResolverMatch.__new__(ResolverMatch)  # a copy (ResolverMatch refuses copy.copy)
        match.__dict__.update(kept.__dict__, kwargs=dict(kept.kwargs))
        request.resolver_match = match
        return match


class Lanes:
    """The WSGI callable: bearer-token API calls through the short chain, the rest through the whole."""

    def __init__(self):
        self.browser = _Handler(list(settings.MIDDLEWARE))
        self.api = _Handler(api_middleware())

    def __call__(self, environ, start_response):
        handler = self.api if bearer_api(environ) else self.browser
        return handler(environ, start_response)
