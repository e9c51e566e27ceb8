"""The ``gpushare`` CLI, run as a process against a live server (and a real agent where a job must run)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django_scopes import scopes_disabled

from gpushare_client import Job as ApiJob
from gpushare_client.cli import job_exit_code
from gpushare_client.cli.app import EXIT_API, EXIT_CANCELLED, EXIT_GAVE_UP, EXIT_TIMEOUT, EXIT_USAGE
from scheduler.models import Job
from tests.factories import TenantFactory, platform_rules_seed, token_for, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _generous_rate_limit(settings):
    """The CLI polls every 0.3 s here (2 s by default): keep the per-token limit out of the way."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}


def run_cli(url: str, token: str, *args: str, timeout: float = 120, env_extra=None, tmp_path=None):
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUSHARE_URL": url,
        "GPUSHARE_TOKEN": token,
        "GPUSHARE_POLL_INTERVAL": "0.3",
        "XDG_CONFIG_HOME": str(tmp_path or ROOT / "var" / "no-config"),
        **(env_extra or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "gpushare_client", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def jobs_of(tenant) -> list[Job]:
    with scopes_disabled():
        return list(Job.objects.filter(tenant=tenant))


@pytest.mark.integration
def test_submit_wait_returns_the_jobs_exit_code_and_streams_its_log(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="ci")
    token = token_for(tenant)
    script = "import sys; print('epoch 1'); print('epoch 2'); sys.exit(7)"
    done = run_cli(
        platform.url, token, "submit", "--wait", "--logs", "--name", "ci-step", "--", sys.executable, "-c", script
    )
    assert done.returncode == 7, done.stderr
    assert "epoch 1\nepoch 2\n" in done.stdout
    assert "failed" in done.stderr and "exit code 7" in done.stderr
    assert "queued" in done.stderr  # progress lines while waiting

    ok = run_cli(
        platform.url, token, "submit", "-q", "--wait", "--gpus", "0.25", "--", sys.executable, "-c", "print(1)"
    )
    assert ok.returncode == 0, ok.stderr
    job_id = int(ok.stdout)  # -q: the job id alone, nothing else on stdout
    assert ok.stderr == ""
    with scopes_disabled():
        job = Job.objects.get(pk=job_id)
    assert job.kind == "inference" and job.gpu_milli == 250 and job.state == "succeeded"

    two = run_cli(
        platform.url, token, "submit", "--wait", "--json", "-q", "--gpus", "2", "--", sys.executable, "-c", "0"
    )
    assert two.returncode == 0, two.stderr
    finished = json.loads(two.stdout)
    assert finished["state"] == "succeeded" and len(finished["gpu_uuids"]) == 2  # both GPUs it held

    status = run_cli(platform.url, token, "status", str(job_id), "--json")
    assert status.returncode == 0 and f'"id": {job_id}' in status.stdout
    listed = run_cli(platform.url, token, "list", "--name", "ci-step")
    assert listed.returncode == 0 and "ci-step" in listed.stdout and "failed" in listed.stdout


@pytest.mark.integration
def test_logs_follow_streams_until_the_job_ends(platform, agent_factory, tmp_path):
    agent_factory("node-1")
    tenant = TenantFactory(slug="ci")
    token = token_for(tenant)
    script = "import time\nfor i in range(6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.5)\n"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: follow-me\nkind: training\ngpus: 1\ncommand: [{sys.executable!r}, -c, {script!r}]\n")
    submitted = run_cli(platform.url, token, "submit", "-q", "-f", str(job_file))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.isdigit()
    follow = run_cli(platform.url, token, "logs", "--follow", job_id, timeout=120)
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout == "".join(f"line {i}\n" for i in range(6))
    with scopes_disabled():
        assert Job.objects.get(pk=int(job_id)).state == "succeeded"


class FlakyProxy:
    """A TCP proxy in front of the live server, with two kinds of trouble.

    ``drop_first``: forward the first request, let the server answer, then drop
    the answer (what a CI runner sees when its network flaps after the
    platform has already created the job). ``down``: while set, every new
    connection is closed at once (an outage). Otherwise it proxies faithfully.
    """

    def __init__(self, upstream_port: int, *, drop_first: bool = False):
        self.upstream_port = upstream_port
        self.drop_first = drop_first
        self.down = False
        self.open: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.down:
                client.close()
                continue
            drop = self.drop_first and self.connections == 1
            threading.Thread(target=self._serve, args=(client, drop), daemon=True).start()

    def outage(self, down: bool):
        """Start (closing every open connection) or end an outage."""
        self.down = down
        if down:
            for s in list(self.open):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self, client: socket.socket, drop: bool):
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        self.open += [client, upstream]
        threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
        while True:
            data = upstream.recv(65536)
            if not data:
                break
            if drop:  # the server has processed the request: lose its answer
                self.dropped.set()
                break
            client.sendall(data)
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def close(self):
        self.listener.close()


def test_a_lost_response_during_submit_does_not_create_a_second_job(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="flaky")
    token = token_for(tenant)
    proxy = FlakyProxy(int(live_server.url.rsplit(":", 1)[1]), drop_first=True)
    try:
        done = run_cli(f"http://127.0.0.1:{proxy.port}", token, "submit", "--", "python", "train.py")
    finally:
        proxy.close()
    assert proxy.dropped.is_set(), "the proxy dropped the first answer"
    assert proxy.connections >= 2, "the CLI retried"
    assert done.returncode == 0, done.stderr
    assert "already submitted" in done.stdout  # the retry got the first attempt's job back
    jobs = jobs_of(tenant)
    assert len(jobs) == 1
    assert done.stdout.startswith(f"job {jobs[0].pk} already submitted")


def test_wait_rides_out_a_platform_outage(live_server, transactional_db):
    from scheduler.services import job_cancel

    platform_rules_seed()
    tenant = TenantFactory(slug="outage")
    token = token_for(tenant)
    submitted = run_cli(live_server.url, token, "submit", "-q", "--", "python", "x.py")
    job_id = int(submitted.stdout.strip())
    proxy = FlakyProxy(int(live_server.url.rsplit(":", 1)[1]))
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUSHARE_URL": f"http://127.0.0.1:{proxy.port}",
        "GPUSHARE_TOKEN": token,
        "GPUSHARE_POLL_INTERVAL": "0.3",
        "XDG_CONFIG_HOME": str(ROOT / "var" / "no-config"),
    }
    waiting = subprocess.Popen(
        [sys.executable, "-m", "gpushare_client", "--retries", "1", "wait", str(job_id)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2)
        proxy.outage(True)  # the platform vanishes for a while...
        time.sleep(4)
        with scopes_disabled():
            job_cancel(job=Job.objects.get(pk=job_id))  # ...and meanwhile the job ends
        proxy.outage(False)
        out, err = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
        proxy.close()
    assert "platform unreachable, still waiting" in err
    assert waiting.returncode == EXIT_CANCELLED, err


def test_wait_timeout_and_cancel(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="patient")
    token = token_for(tenant)
    # No agent: the job stays queued.
    done = run_cli(live_server.url, token, "submit", "--wait", "--timeout", "1.5", "--", "python", "x.py")
    assert done.returncode == EXIT_TIMEOUT, done.stderr
    assert "position 1 in the queue" in done.stderr
    job_id = jobs_of(tenant)[0].pk
    cancelled = run_cli(live_server.url, token, "cancel", str(job_id))
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    waited = run_cli(live_server.url, token, "wait", str(job_id))
    assert waited.returncode == EXIT_CANCELLED


def test_refusals_and_configuration(live_server, transactional_db, tmp_path):
    platform_rules_seed()
    tenant = TenantFactory(slug="conf")
    token = token_for(tenant)
    bad = run_cli(live_server.url, token, "submit", "--priority", "vip-please", "--", "x")
    assert bad.returncode == EXIT_API and "priority" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr  # said once
    odd = run_cli(live_server.url, token, "submit", "--gpus", "3.5", "--", "x")
    assert odd.returncode == EXIT_USAGE
    assert odd.stderr.count("3.5") == 1 and "0.125, 0.25 or 0.5" in odd.stderr, odd.stderr
    assert not jobs_of(tenant)
    assert run_cli(live_server.url, "gps_wrong", "list").returncode == EXIT_API
    other = TenantFactory(slug="other")
    assert run_cli(live_server.url, token_for(other), "status", "999999").returncode == EXIT_API
    assert run_cli(live_server.url, token, "submit").returncode == EXIT_USAGE  # no command

    # The config file, when the environment says nothing.
    (tmp_path / "gpushare").mkdir()
    (tmp_path / "gpushare" / "config.toml").write_text(f'url = "{live_server.url}"\ntoken = "{token}"\n')
    from_file = run_cli("", "", "list", "--json", tmp_path=tmp_path)
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout) == {"results": []}
    assert run_cli("", "", "list", tmp_path=tmp_path / "nowhere").returncode == EXIT_USAGE


@pytest.mark.parametrize(
    ("job", "code"),
    [
        ({"state": "succeeded", "exit_code": 0}, 0),
        ({"state": "failed", "exit_code": 3}, 3),
        ({"state": "failed", "exit_code": None}, 1),
        ({"state": "failed", "exit_code": -9}, 137),
        ({"state": "failed", "exit_code": 300}, 1),
        ({"state": "cancelled", "exit_code": None}, EXIT_CANCELLED),
        ({"state": "lost", "exit_code": None}, EXIT_GAVE_UP),
        ({"state": "preempted", "exit_code": None}, EXIT_GAVE_UP),
    ],
)
def test_exit_codes(job, code):
    assert job_exit_code(ApiJob.from_api({"id": 1, "kind": "training", "gpus": 1, **job})) == code


def test_quota_usage_and_estimate(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="reader")
    token = token_for(tenant)
    quota = run_cli(live_server.url, token, "quota", "--json")
    assert quota.returncode == 0, quota.stderr
    assert '"headroom"' in quota.stdout
    usage = run_cli(live_server.url, token, "usage", "--group-by", "job", "--json")
    assert usage.returncode == 0, usage.stderr
    assert '"results": []' in usage.stdout
    estimate = run_cli(live_server.url, token, "estimate", "--gpus", "2", "--max-runtime-seconds", "3600", "--json")
    assert estimate.returncode == 0, estimate.stderr
    assert "H100-80GB" in estimate.stdout
    bad = run_cli(live_server.url, token, "usage", "--start", "2026-02-01T00:00:00Z", "--end", "2026-01-01T00:00:00Z")
    assert bad.returncode == EXIT_API and "end must be after start" in bad.stderr


@pytest.mark.integration
def test_cancel_stops_a_running_job(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="ci")
    token = token_for(tenant)
    script = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
    submitted = run_cli(platform.url, token, "submit", "-q", "--", sys.executable, "-c", script)
    job_id = submitted.stdout.strip()
    session = platform.session_for(tenant)
    wait_for(
        lambda: session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=10).json()["state"] == "running",
        timeout=60,
        what="the job to run",
    )
    cancel = run_cli(platform.url, token, "cancel", job_id)
    assert cancel.returncode == 0 and "stopping" in cancel.stdout, cancel.stderr
    waited = run_cli(platform.url, token, "wait", job_id, "--logs", "--timeout", "60")
    assert waited.returncode == EXIT_CANCELLED, waited.stderr
    assert "started\n" in waited.stdout
    with scopes_disabled():
        job = Job.objects.get(pk=int(job_id))
    assert job.state == "cancelled" and (job.finished_at - job.started_at).total_seconds() < 60
