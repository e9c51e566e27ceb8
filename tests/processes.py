"""Real processes for integration tests: a Celery worker and node agents.

They run against the test database (the one pytest-django created) and the
Redis database named by REDIS_URL (flushed when the worker starts, so stale
messages of an earlier run cannot leak in).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests
from django.conf import settings

from tests.factories import platform_rules_seed, token_for, wait_for

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "var" / "test-logs"


def process_env(extra: dict | None = None) -> dict:
    from django.db import connection

    db = connection.settings_dict
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="gpushare.settings.test",
        DATABASE_URL=f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        REDIS_URL=settings.REDIS_URL,
        PYTHONUNBUFFERED="1",
        GPUSHARE_WEBHOOK_ALLOWED_NETWORKS="127.0.0.1/32",  # the tests' webhook receivers listen on loopback
    )
    if db.get("PASSWORD"):
        env["DATABASE_URL"] = env["DATABASE_URL"].replace(f"{db['USER']}@", f"{db['USER']}:{db['PASSWORD']}@")
    env.update(extra or {})
    return env


def _spawn(name: str, argv: list[str], env: dict) -> tuple[subprocess.Popen, Path]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{name}.log"
    out = open(log_path, "ab")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log_path


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    log_path: Path
    ops_url: str = ""  # its /healthz /readyz /metrics (gpushare/observability/worker.py)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def celery_worker_process(django_db_setup, django_db_blocker):
    """One real Celery worker for the session (stopped before the test DB is dropped)."""
    redis.Redis.from_url(settings.REDIS_URL).flushdb()
    with django_db_blocker.unblock():
        env = process_env()
    name = f"worker-{uuid.uuid4().hex[:6]}"
    ops_port = free_port()
    env.update(GPUSHARE_METRICS_PORT=str(ops_port), GPUSHARE_HEARTBEAT_DIR=str(LOG_DIR / f"{name}-heartbeat"))
    proc, log_path = _spawn(
        name,
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "gpushare",
            "worker",
            "-Q",
            "platform",
            "-c",
            "2",
            "-l",
            "info",
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env,
    )
    wait_for(lambda: b"ready." in log_path.read_bytes() or proc.poll() is not None, timeout=60, what="worker ready")
    if proc.poll() is not None:
        raise RuntimeError(f"celery worker exited: {log_path.read_text()[-3000:]}")
    yield WorkerProcess(proc, log_path, ops_url=f"http://127.0.0.1:{ops_port}")
    _stop(proc)


@dataclass
class AgentProcess:
    node: str
    token: str
    argv: list[str]
    env: dict
    var_dir: Path
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> AgentProcess:
        self.proc, self.log_path = _spawn(f"agent-{self.node}", self.argv, self.env)
        return self

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc)

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


@dataclass
class Platform:
    url: str
    agents: list[AgentProcess] = field(default_factory=list)

    def session_for(self, tenant, **token_kwargs) -> requests.Session:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {token_for(tenant, **token_kwargs)}"
        return s


@pytest.fixture
def agent_factory(transactional_db, tmp_path, celery_worker_process):
    """``agent_factory(name, gpus=..., extra=[...])`` starts a node agent and waits for it to register."""
    from agents.models import Node
    from agents.nodelink import trusted_keys
    from agents.services import node_credential_issue

    started: list[AgentProcess] = []

    def make(node: str = "node-1", *, gpus: str = "sim:2xH100-80GB,2xL4-24GB", extra=(), wait: bool = True):
        token = node_credential_issue(name=node)
        var_dir = tmp_path / f"agent-{node}"
        argv = [
            sys.executable,
            "-m",
            "agents",
            "--node",
            node,
            "--broker",
            settings.REDIS_URL,
            "--var-dir",
            str(var_dir),
            "--gpus",
            gpus,
            "--sample-interval",
            "0.2",
            "--window",
            "1",
            "--heartbeat",
            "1",
            *extra,
        ]
        env = process_env()
        for secret in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE"):
            env.pop(secret, None)  # the agent never needs the database
        env["GPUSHARE_AGENT_TOKEN"] = token  # as the systemd unit passes it: never on the command line
        env["GPUSHARE_NODELINK_PUBLIC_KEYS"] = ",".join(trusted_keys())  # verifies the platform's commands
        # These tests' jobs run this venv's interpreter (under /root here, which no job uid can enter):
        # single-tenant unless a test asks for --tenancy multi (tests/security/ does).
        env.setdefault("GPUSHARE_AGENT_TENANCY", "single")
        agent = AgentProcess(node=node, token=token, argv=argv, env=env, var_dir=var_dir).start()
        started.append(agent)
        if wait:
            wait_for(
                lambda: (
                    Node.objects.filter(name=node, state=Node.State.UP, gpus__isnull=False).exists()
                    or agent.proc.poll() is not None
                ),
                timeout=30,
                what=f"agent {node} to register",
            )
            if agent.proc.poll() is not None:
                raise RuntimeError(f"agent {node} exited: {agent.log()[-3000:]}")
        return agent

    yield make
    for agent in started:
        agent.stop()


@pytest.fixture
def platform(live_server, agent_factory):
    """Live HTTP server + worker + the demo's rules and prices; agents via ``agent_factory``."""
    platform_rules_seed()
    return Platform(url=live_server.url)


@pytest.fixture
def gateway(platform):
    """A real endpoint gateway process on a free port (the platform's host); yields its base URL."""
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


# --- localstripe ------------------------------------------------------------------


@pytest.fixture
def localstripe(settings, tmp_path):
    """A localstripe process on a free port; settings point the gateway at it."""
    port = free_port()
    log = open(tmp_path / "localstripe.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return requests.get(f"{base}/v1/customers", auth=("sk_test_local", ""), timeout=1).status_code == 200
        except requests.ConnectionError:
            return proc.poll() is not None

    wait_for(up, timeout=60, what="localstripe to listen")
    assert proc.poll() is None, (tmp_path / "localstripe.log").read_text()
    settings.STRIPE_API_BASE = base
    settings.STRIPE_API_KEY = "sk_test_local"
    settings.STRIPE_LOCALSTRIPE = True
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def nft_tables() -> str:
    """The host's nftables tables ("" when not root or without nft: an agent there runs single-tenant)."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("nft"):
        return ""
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=30).stdout
