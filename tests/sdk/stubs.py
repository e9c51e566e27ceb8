"""A real HTTP server in front of the live server that answers some requests itself:
throttling (429/503 with Retry-After) and recording what clients sent."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests


class Stub:
    """``busy``: answer this many requests with ``busy_status`` and ``Retry-After: retry_after``
    (-1: all of them) before forwarding to ``upstream``; ``answer``: reply with this JSON
    instead of forwarding. Every request is recorded in ``seen`` (method, path, headers, body, time)."""

    def __init__(self, upstream: str = "", *, busy: int = 0, busy_status: int = 503, retry_after: str = "1"):
        self.upstream, self.busy, self.busy_status, self.retry_after = upstream, busy, busy_status, retry_after
        self.answer: tuple[int, dict] | None = None
        self.seen: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                stub.seen.append(
                    {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body,
                     "at": time.monotonic()}
                )  # fmt: skip
                if stub.busy != 0:
                    stub.busy -= 1 if stub.busy > 0 else 0
                    code = "rate_limited" if stub.busy_status == 429 else "server_error"
                    error = {"error": {"code": code, "message": "busy", "fields": {}}}
                    return self._reply(stub.busy_status, error, {"Retry-After": stub.retry_after})
                if stub.answer is not None:
                    return self._reply(*stub.answer)
                upstream = requests.request(
                    self.command, stub.upstream + self.path, data=body,
                    headers={k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")},
                    timeout=30,
                )  # fmt: skip
                self.send_response(upstream.status_code)
                self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(upstream.content)))
                self.end_headers()
                self.wfile.write(upstream.content)

            def _reply(self, status: int, body: dict, headers: dict | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
