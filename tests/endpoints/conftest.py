"""Processes for endpoint tests: the gateway and Celery beat (the autoscaler's clock)."""

from __future__ import annotations

import socket
import sys
import uuid

import pytest
import requests

from tests.factories import wait_for
from tests.processes import _spawn, _stop, process_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gateway(platform):
    """A real gateway process on a free port; yields its base URL."""
    port = free_port()
    proc, log_path = _spawn(
        f"gateway-{uuid.uuid4().hex[:6]}",
        [sys.executable, "-m", "endpoints", "--port", str(port), "--refresh", "0.25", "--cold-start-timeout", "90"],
        process_env(),
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log_path.read_text()[-3000:]}")
        try:
            return requests.get(f"{url}/healthz", timeout=1).ok
        except requests.ConnectionError:
            return False

    wait_for(up, timeout=30, what="the gateway")
    yield url
    _stop(proc)


@pytest.fixture
def beat(platform, tmp_path):
    """Celery beat: periodic scheduling passes and autoscaling, as in production."""
    proc, _ = _spawn(
        f"beat-{uuid.uuid4().hex[:6]}",
        [sys.executable, "-m", "celery", "-A", "gpushare", "beat", "-l", "info", "-s", str(tmp_path / "beat")],
        process_env(),
    )
    yield proc
    _stop(proc)
