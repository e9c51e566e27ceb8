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
"""

from __future__ import annotations

from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler


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


class _Handler(WSGIHandler):
    """Django's WSGI handler, its chain built from ``middleware`` instead of ``settings.MIDDLEWARE``."""

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


class Lanes:
    """The WSGI callable: bearer-token API calls through the short chain, the rest through the whole."""

    def __init__(self):
        self.browser = WSGIHandler()
        self.api = _Handler(api_middleware())

    def __call__(self, environ, start_response):
        handler = self.api if bearer_api(environ) else self.browser
        return handler(environ, start_response)
