"""A tiny "model server" for endpoint tests: answers on $PORT, sleeps per request.

GET /health -> 200; GET|POST /predict -> JSON with the replica's version, pid and the
caller's address after SLEEP_S seconds; GET /stream -> 5 chunks, 0.2 s apart (token streaming).
Listens on $BIND (default 127.0.0.1; 0.0.0.0 for a gateway on another host).
"""

import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLEEP_S = float(os.environ.get("SLEEP_S", "0.2"))
VERSION = os.environ.get("MODEL_VERSION", "1")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The headers and the body go out in two writes: with Nagle's algorithm on, the body waits for the
    # client's delayed ACK of the headers (~40 ms a request on Linux). Model servers (uvicorn, TorchServe)
    # send with TCP_NODELAY; without it the "replica called directly" reference of the gateway bench
    # was capped near 100 / 0.04 s = 2,500 req/s at 100 in flight and its p50 was ~44 ms at any rate.
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._json(200, {"ok": True})
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                chunk = f"token{i}\n".encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
                time.sleep(0.2)
            self.wfile.write(b"0\r\n\r\n")
            return None
        return self.do_POST()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        time.sleep(SLEEP_S)
        return self._json(
            200,
            {
                "version": VERSION,
                "pid": os.getpid(),
                "echo": body.decode(errors="replace"),
                "peer": self.client_address[0],
            },
        )


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog (5) resets connections under a burst


Server((os.environ.get("BIND", "127.0.0.1"), int(os.environ["PORT"])), Handler).serve_forever()
