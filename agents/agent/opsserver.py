"""A small HTTP server for ``/healthz``, ``/readyz`` and ``/metrics`` (pure Python, no Django).

Used by the node agent and by the Celery worker and beat, which have no web
server of their own. It runs in a daemon thread beside the process's work.
Protection: it listens on ``127.0.0.1`` unless told otherwise, and when a
token is set ``/metrics`` needs ``Authorization: Bearer <token>`` (the health
paths stay open: they say ready or not and why, which a kubelet must read
without credentials).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("gpushare.ops")

Check = Callable[[], tuple[bool, dict]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


def token_allows(authorization: str, token: str) -> bool:
    """True when no token is required, or ``authorization`` is ``Bearer <token>``."""
    if not token:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


class OpsServer:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        live: Check,
        ready: Check,
        registry: CollectorRegistry | Callable[[], CollectorRegistry],
        token: str = "",
    ):
        self.live, self.ready, self.token = live, ready, token
        self._registry = registry
        self._server = make_server(host, port, self.app, server_class=_Server, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread: threading.Thread | None = None

    def registry(self) -> CollectorRegistry:
        return self._registry() if callable(self._registry) else self._registry

    def app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, body = (self.live if path == "/healthz" else self.ready)()
            data = json.dumps(body).encode()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [data]
        if path == "/metrics":
            if not token_allows(environ.get("HTTP_AUTHORIZATION", ""), self.token):
                start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
                return [b"send Authorization: Bearer <metrics token>\n"]
            return make_wsgi_app(self.registry())(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: /healthz, /readyz, /metrics\n"]

    def start(self) -> OpsServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="ops-server", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        log.info("health and metrics on http://%s:%s (/healthz, /readyz, /metrics)", host, port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
