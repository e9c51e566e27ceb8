"""Fixtures for the operations tests: cuttable links to PostgreSQL and Redis, a web server, beat."""

from __future__ import annotations

import sys
import uuid

import pytest
from django.conf import settings

from chaos.proxy import CuttableProxy
from tests.factories import wait_for
from tests.processes import _spawn, _stop, free_port, process_env

from .helpers import status


@pytest.fixture
def pg_proxy():
    from django.db import connection

    db = connection.settings_dict
    proxy = CuttableProxy(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432))
    yield proxy
    proxy.close()


@pytest.fixture
def redis_proxy():
    from urllib.parse import urlparse

    url = urlparse(settings.REDIS_URL)
    proxy = CuttableProxy(url.hostname or "127.0.0.1", url.port or 6379)
    yield proxy
    proxy.close()


def via(proxy: CuttableProxy, url: str) -> str:
    """``url`` (postgres:// or redis://) with its host and port replaced by the proxy's."""
    from urllib.parse import urlparse, urlunparse

    parsed = urlparse(url)
    auth = parsed.netloc.rsplit("@", 1)[0] + "@" if "@" in parsed.netloc else ""
    return urlunparse(parsed._replace(netloc=f"{auth}127.0.0.1:{proxy.port}"))


@pytest.fixture
def spawn():
    """``spawn(name, argv, env)`` -> (proc, log path); stopped at the end of the test."""
    started = []

    def make(name: str, argv: list[str], env: dict):
        proc, log_path = _spawn(f"{name}-{uuid.uuid4().hex[:6]}", argv, env)
        started.append(proc)
        return proc, log_path

    yield make
    for proc in started:
        _stop(proc)


def web_server(spawn, env: dict, workers: int = 2) -> str:
    """The web server as deployed (``gpushare.serve``: multiprocess metrics), two workers, on a free port;
    returns its URL."""
    port = free_port()
    proc, log_path = spawn(
        "web",
        [sys.executable, "-m", "gpushare.serve", "--bind", f"127.0.0.1:{port}", "--workers", str(workers)],
        env,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"the web server exited: {log_path.read_text()[-3000:]}")
        return status(url, "/readyz") == 200  # booted, Django loaded, first connections made

    wait_for(up, timeout=90, what="the web server")
    return url


def beat_process(spawn, tmp_path, env_extra: dict | None = None):
    """Celery beat with its ops server; returns (proc, ops URL)."""
    port = free_port()
    env = process_env(
        {
            "GPUSHARE_METRICS_PORT": str(port),
            "GPUSHARE_HEARTBEAT_DIR": str(tmp_path / "beat-heartbeat"),
            **(env_extra or {}),
        }
    )
    proc, _ = spawn(
        "beat",
        [sys.executable, "-m", "celery", "-A", "gpushare", "beat", "-l", "info", "-s", str(tmp_path / "beat-schedule")],
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: status(url, "/healthz") == 200 or proc.poll() is not None, timeout=60, what="beat's ops server")
    assert proc.poll() is None, "beat exited"
    return proc, url
