"""The demo endpoint `make run` seeds: an echo "model" scaled to zero, so the gateway can be
tried with one curl (README, Quick start)."""

from __future__ import annotations

import shutil
import sys

from accounts.tenancy import acts_for_tenant

from .models import Endpoint
from .services import EndpointSpec, endpoint_create

DEMO_NAME = "echo"
# A model server with no dependencies: answers JSON on $PORT (GET: where; POST: the body back).
ECHO_SERVER = """
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Echo(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"model": "echo", "path": self.path})

    def do_POST(self):
        size = int(self.headers.get("Content-Length") or 0)
        self.reply({"model": "echo", "echo": self.rfile.read(size).decode("utf-8", "replace")})

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Echo).serve_forever()
"""


@acts_for_tenant
def demo_endpoint_ensure(*, tenant, user=None) -> Endpoint:
    """The tenant's ``echo`` endpoint (min 0, max 1, a 1/8 slice); created once, kept as it is after."""
    found = Endpoint.objects.filter(tenant=tenant, name=DEMO_NAME, state=Endpoint.State.ACTIVE).first()
    if found is not None:
        return found
    spec = EndpointSpec(
        name=DEMO_NAME,
        command=[_interpreter(), "-c", ECHO_SERVER],
        gpu_milli=125,
        min_replicas=0,
        max_replicas=1,
        idle_timeout_s=120,
        health_path="/health",
    )
    return endpoint_create(tenant=tenant, user=user, spec=spec)


def _interpreter() -> str:
    """The host's python3 (every job uid can run it; a venv may sit where only its owner can enter,
    such as /root), else this interpreter."""
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
