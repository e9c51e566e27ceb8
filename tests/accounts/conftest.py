"""Fixtures for the accounts tests."""

from __future__ import annotations

import threading

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import connections


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


class _WideBacklogServer(ThreadedWSGIServer):
    """Django's threaded dev server with a listen backlog big enough for a 50-request burst
    (the stock one queues 10 connections and resets the rest)."""

    request_queue_size = 256


class _App(WSGIHandler):
    def __call__(self, environ, start_response):
        try:
            return super().__call__(environ, start_response)
        finally:
            connections.close_all()


@pytest.fixture
def burst_server(transactional_db):
    """A live HTTP server (one thread per request) for concurrency tests; yields its base URL."""
    server = _WideBacklogServer(("127.0.0.1", 0), _QuietHandler, allow_reuse_address=False)
    server.set_app(_App())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
