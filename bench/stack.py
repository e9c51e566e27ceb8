"""The platform as it is deployed, started by the harness for one run.

The web server as deployed (``gpushare.serve``: granian, the real WSGI app), a
Celery worker (with beat) and a node agent on simulated GPUs, against
PostgreSQL (its own database, dropped and migrated at start) and Redis (its own
db number, flushed at start). The harness process itself is configured as one
more Django client of that database, to seed rules and tenants and to read
results.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import requests

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gpushare_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/7"


class StackError(RuntimeError):
    pass


@dataclass
class StackConfig:
    database_url: str = os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)
    redis_url: str = os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL)
    web_workers: int = int(os.environ.get("BENCH_WEB_WORKERS", "3"))
    web_threads: int = int(os.environ.get("BENCH_WEB_THREADS", "4"))
    worker_concurrency: int = int(os.environ.get("BENCH_WORKER_CONCURRENCY", "2"))
    worker_prefetch: int = int(os.environ.get("BENCH_WORKER_PREFETCH", "4"))
    gpus: str = "sim:8xH100-80GB"
    sample_interval_s: float = 0.2
    window_s: float = 1.0
    heartbeat_s: float = 1.0
    node: str = "bench-node"
    # Extra environment for every platform process (GPUSHARE_* knobs a chaos case needs).
    extra_env: dict = field(default_factory=dict)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def platform_env(config: StackConfig, var_dir: Path) -> dict:
    """Environment of every platform process (and of the harness's Django)."""
    return {
        "DJANGO_SETTINGS_MODULE": "bench.settings",  # production + a bare view (bench/urls.py)
        "SECRET_KEY": "bench-secret-key-0123456789-abcdefghijklmnopqrstuvwxyz",  # production's rules: 50+ chars
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "GPUSHARE_STRIPE_TEST_MODE": "1",  # localstripe / nothing: no real money
        "GPUSHARE_SSL_REDIRECT": "0",  # plain HTTP on loopback
        "GPUSHARE_NODELINK_AUTO_KEY": "1",  # a throwaway command-signing key under the stack's var/
        "DATABASE_URL": config.database_url,
        "REDIS_URL": config.redis_url,
        "STRIPE_API_KEY": "sk_test_bench",
        "STRIPE_WEBHOOK_SECRET": "whsec_bench",
        "STRIPE_API_BASE": "http://127.0.0.1:9",
        "GPUSHARE_VAR_DIR": str(var_dir),
        # The benchmark measures the machinery, not the per-token rate limit.
        "GPUSHARE_API_RATE": "100000/s",  # a 1 s window keeps the throttle history short
        "GPUSHARE_TENANT_API_RATE": "100000/s",  # and not the tenant's plan limit (600/min) either
        "CELERY_WORKER_PREFETCH_MULTIPLIER": str(config.worker_prefetch),
        "LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
        **config.extra_env,
    }


def django_setup(config: StackConfig, var_dir: Path) -> None:
    """Configure this process as a Django client of the bench database (once)."""
    os.environ.update(platform_env(config, var_dir))
    import django

    django.setup()


def database_recreate(database_url: str) -> None:
    """Drop and create the bench database (never any other one)."""
    import psycopg2

    url = urlparse(database_url)
    name = url.path.lstrip("/")
    if "bench" not in name and "chaos" not in name:
        raise StackError(f"refusing to drop database {name!r}: its name must contain 'bench' or 'chaos'")
    conn = psycopg2.connect(
        host=url.hostname or "127.0.0.1",
        port=url.port or 5432,
        user=url.username or "postgres",
        password=url.password,
        dbname="postgres",
    )
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signum)

    def stop(self, timeout: float = 20) -> None:
        if not self.alive:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """kill -9 the whole process group, as a crash would."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@dataclass
class Stack:
    workdir: Path
    config: StackConfig = field(default_factory=StackConfig)
    port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)
    node_token: str = ""
    tenant_token: str = ""
    tenant_id: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def var_dir(self) -> Path:
        return self.workdir / "var"

    @property
    def env(self) -> dict:
        return {**os.environ, **platform_env(self.config, self.var_dir)}

    # --- setup -------------------------------------------------------------

    def prepare(self) -> None:
        """Fresh database and Redis db, migrated and seeded; this process set up as a Django client."""
        import redis

        self.var_dir.mkdir(parents=True, exist_ok=True)
        database_recreate(self.config.database_url)
        redis.Redis.from_url(self.config.redis_url).flushdb()
        django_setup(self.config, self.var_dir)
        from django.core.management import call_command
        from django.db import connections

        # The database was just dropped with every session on it, this process's own included (a second
        # stack in the same run: the isolation benchmark's): connect again rather than use a dead session.
        connections.close_all()

        call_command("migrate", "--noinput", verbosity=0)
        self.seed()

    def seed(self) -> None:
        from django_scopes import scopes_disabled

        from accounts.services import ALL_SCOPES, tenant_create, token_create
        from agents.services import node_credential_issue
        from console.management.commands.seed_demo import prices_ensure, priority_classes_ensure

        with scopes_disabled():
            priority_classes_ensure()
            prices_ensure()
            tenant = tenant_create(slug="bench", name="Bench", owner_email="bench@bench.test", owner_password=None)
            from accounts.models import Membership

            user = Membership.objects.get(tenant=tenant).user
            self.tenant_token = token_create(tenant=tenant, user=user, name="bench", scopes=ALL_SCOPES).plaintext
            self.tenant_id = tenant.pk
        self.node_token = node_credential_issue(name=self.config.node)

    # --- processes ---------------------------------------------------------

    def _proc(self, name: str, argv: list[str], env: dict | None = None) -> Proc:
        proc = Proc(name, argv, env or self.env, self.workdir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def web_start(self) -> None:
        self.port = self.port or free_port()
        c = self.config
        self._proc(
            "web",
            [
                str(BIN / "python"),
                "-m",
                "gpushare.serve",  # as deployed (Dockerfile, docker-compose, Kubernetes)
                "--bind",
                f"127.0.0.1:{self.port}",
                "--workers",
                str(c.web_workers),
                "--threads",
                str(c.web_threads),
            ],
        ).start()
        self.wait(lambda: self._http_ok(), 60, "the web server to answer", "web")

    def _http_ok(self) -> bool:
        try:
            return requests.get(f"{self.url}/api/v1/jobs/", timeout=2).status_code in (200, 401, 403)
        except requests.RequestException:
            return False

    def worker_start(self, name: str = "worker", *, beat: bool = True) -> Proc:
        c = self.config
        argv = [
            str(BIN / "celery"),
            "-A",
            "gpushare",
            "worker",
            "-Q",
            "platform",
            "-c",
            str(c.worker_concurrency),
            "--prefetch-multiplier",
            str(c.worker_prefetch),
            "-l",
            "info",
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        if beat:
            argv += ["-B", "-s", str(self.workdir / "celerybeat-schedule")]
        # INFO: Celery's "ready." line is what the wait below looks for (LOG_LEVEL=WARNING hides it).
        proc = self._proc(name, argv, {**self.env, "LOG_LEVEL": "INFO"}).start()
        self.wait(lambda: b"ready." in proc.log_path.read_bytes(), 60, f"{name} ready", name)
        return proc

    def agent_argv(self, *, broker_url: str | None = None, extra: tuple[str, ...] = (), **override) -> list[str]:
        """The agent's command line; ``override`` replaces node, token, gpus, sample_interval_s, window_s..."""
        c = {
            "node": self.config.node,
            "token": self.node_token,
            "gpus": self.config.gpus,
            "sample_interval_s": self.config.sample_interval_s,
            "window_s": self.config.window_s,
            "heartbeat_s": self.config.heartbeat_s,
            **override,
        }
        return [
            sys.executable,
            "-m",
            "agents",
            "--node",
            c["node"],
            "--token",
            c["token"],
            "--broker",
            broker_url or self.config.redis_url,
            "--var-dir",
            str(self.var_dir / "agent"),
            "--gpus",
            c["gpus"],
            "--sample-interval",
            str(c["sample_interval_s"]),
            "--window",
            str(c["window_s"]),
            "--heartbeat",
            str(c["heartbeat_s"]),
            "--log-level",
            "WARNING",
            *extra,
        ]

    def agent_env(self, extra: dict | None = None) -> dict:
        """The agent never gets the database's address or the platform's secrets."""
        from agents import nodelink

        env = {k: v for k, v in self.env.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY")}
        # The stack's command-signing key (its processes' GPUSHARE_VAR_DIR/nodelink): the agent verifies with it.
        key = nodelink.key_create(folder=self.var_dir / "nodelink")
        env["GPUSHARE_NODELINK_PUBLIC_KEYS"] = nodelink.public_text(key)
        # Benchmark jobs write into the harness's own (private) dirs: single-tenant unless a case asks
        # for --tenancy multi (bench/isolation_launch.py measures what multi-tenant costs at launch).
        env.setdefault("GPUSHARE_AGENT_TENANCY", "single")
        env.update(extra or {})
        return env

    def agent_start(
        self,
        *,
        name: str = "agent",
        broker_url: str | None = None,
        extra: tuple[str, ...] = (),
        wait: bool = True,
        env: dict | None = None,
        **override,
    ) -> Proc:
        node = override.get("node", self.config.node)
        argv = self.agent_argv(broker_url=broker_url, extra=extra, **override)
        proc = self._proc(name, argv, self.agent_env(env)).start()
        if wait:
            self.wait(lambda: self.node_up(node), 60, f"agent {node} to register", name)
        return proc

    def node_up(self, name: str | None = None) -> bool:
        from agents.models import Gpu, Node

        node = Node.objects.filter(name=name or self.config.node).first()
        return bool(node and node.state == Node.State.UP and Gpu.objects.filter(node=node).exists())

    def start(self) -> Stack:
        self.prepare()
        self.worker_start()
        self.web_start()
        self.agent_start()
        return self

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def wait(self, predicate, timeout: float, what: str, proc_name: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            proc = self.procs.get(proc_name) if proc_name else None
            if proc is not None and not proc.alive:
                raise StackError(f"{proc_name} exited while waiting for {what}:\n{proc.log_tail()}")
            time.sleep(0.1)
        tail = self.procs[proc_name].log_tail() if proc_name in self.procs else ""
        raise StackError(f"timed out after {timeout}s waiting for {what}\n{tail}")

    # --- helpers the benchmarks share --------------------------------------

    def session(self) -> requests.Session:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {self.tenant_token}"
        return s

    def node_state_set(self, state: str, name: str | None = None) -> None:
        """Cordon/uncordon a node (the harness writes its own database directly)."""
        from agents.models import Node

        Node.objects.filter(name=name or self.config.node).update(state=state)

    def schedule_pass_request(self) -> None:
        from gpushare.celery import app

        app.send_task("scheduler.pass", queue="platform")

    def arrays_waiting_make(self) -> int:
        """Harness reset: the tasks of arrays the scheduler has not made yet become jobs (then cancellable)."""
        from scheduler.array_services import arrays_waiting_make

        return arrays_waiting_make()

    def jobs_cancel_queued(self, settle_s: float = 0.5) -> int:
        """Harness reset between runs: queued jobs are marked cancelled in one statement, and again every
        ``settle_s`` until none is left: the submits a load generator had in flight when it stopped commit
        a little after it returns (a few dozen stayed queued, so the next run's first page of jobs showed
        queued jobs, which the list page's cache never keeps)."""
        cancelled = self._queued_cancel()
        time.sleep(settle_s)
        while late := self._queued_cancel():
            cancelled += late
            time.sleep(settle_s)
        return cancelled

    @staticmethod
    def _queued_cancel() -> int:
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("UPDATE scheduler_job SET state = 'cancelled', finished_at = now() WHERE state = 'queued'")
            return cur.rowcount

    def tables_settle(self) -> None:
        """Harness reset after a bulk change (thousands of jobs submitted, then cancelled): vacuum the job
        tables now, so that autovacuum does not do it in the middle of the next measured run."""
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute(
                "VACUUM (ANALYZE) scheduler_job, scheduler_openjob, scheduler_jobevent, scheduler_openjobcountchange"
            )

    def jobs_unfinished(self, ids: list[int] | None = None) -> int:
        from django_scopes import scopes_disabled

        from scheduler.models import ACTIVE_STATES, Job, JobState

        with scopes_disabled():
            qs = Job.objects.filter(state__in=[*ACTIVE_STATES, JobState.QUEUED])
            if ids is not None:
                qs = qs.filter(pk__in=ids)
            return qs.count()
