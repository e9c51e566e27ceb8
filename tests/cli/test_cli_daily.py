"""Daily use of the CLI, run as a process against a live server: ``run`` (streaming, exit code,
Ctrl-C cancels, a second Ctrl-C detaches), ``-q`` in a shell, pipes, human and JSON output,
help text, completion, arrays."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django_scopes import scopes_disabled

from gpushare_client.cli.app import EXIT_CANCELLED, EXIT_INTERRUPTED, EXIT_USAGE
from scheduler.models import Job
from tests.api.helpers import job_make
from tests.factories import TenantFactory, platform_rules_seed, token_for, wait_for

from .test_cli import ROOT, run_cli

GPUSHARE = str(Path(sys.executable).parent / "gpushare")  # the console script `pip install` makes


@pytest.fixture(autouse=True)
def _generous_rate_limit(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}


@pytest.fixture
def acme(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="acme")
    return live_server.url, token_for(tenant), tenant


def shell(url: str, token: str, script: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": f"{Path(GPUSHARE).parent}:/usr/bin:/bin",
        "GPUSHARE_URL": url,
        "GPUSHARE_TOKEN": token,
        "GPUSHARE_POLL_INTERVAL": "0.3",
        "XDG_CONFIG_HOME": str(ROOT / "var" / "no-config"),
    }
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_q_gives_scripts_the_job_id(acme):
    url, token, tenant = acme
    done = shell(url, token, 'set -e; J=$(gpushare submit -q -- python train.py); echo "job=$J"')
    assert done.returncode == 0, done.stderr
    with scopes_disabled():
        job = Job.objects.get(tenant=tenant)
    assert done.stdout == f"job={job.pk}\n" and done.stderr == ""


def test_a_closed_pipe_is_no_traceback(acme):
    url, token, tenant = acme
    for i in range(30):
        job_make(tenant, name=f"j{i}")
    done = shell(url, token, "gpushare list --limit 30 | true; gpushare list --limit 30 | head -n 2")
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stdout.splitlines()[0].split() == ["ID", "STATE", "KIND", "GPUS", "SUBMITTED", "NAME"]


def test_human_output_by_default_and_json_everywhere(acme):
    url, token, tenant = acme
    job = job_make(tenant, name="shown")
    for args in (("quota",), ("usage",), ("usage", "--group-by", "day"), ("estimate", "--gpus", "2")):
        human = run_cli(url, token, *args)
        assert human.returncode == 0, human.stderr
        assert not human.stdout.lstrip().startswith(("{", "[")), human.stdout
        for flag in (["-o", "json"], ["--json"]):
            machine = run_cli(url, token, *args, *flag)
            assert machine.returncode == 0, machine.stderr
            json.loads(machine.stdout)
        assert json.loads(run_cli(url, token, "-o", "json", *args).stdout)  # before the command too
    quota = run_cli(url, token, "quota").stdout
    assert "HEADROOM" in quota and "dedicated GPUs" in quota and "this month" in quota
    estimate = run_cli(url, token, "estimate", "--gpus", "2", "--max-runtime-seconds", "7200").stdout
    assert "H100-80GB" in estimate and "AT MOST" in estimate and "$" in estimate and "for at most 2 h" in estimate
    for args in (("status", str(job.pk)), ("list",), ("endpoint", "list")):
        assert json.loads(run_cli(url, token, *args, "-o", "json").stdout) is not None
    assert "shown" in run_cli(url, token, "status", str(job.pk)).stdout
    cancelled = json.loads(run_cli(url, token, "cancel", str(job.pk), "--json").stdout)
    assert cancelled["id"] == job.pk and cancelled["state"] == "cancelled"


def test_help_is_plain_text():
    for args in ([], ["submit"], ["run"], ["endpoint", "deploy"], ["estimate"]):
        done = subprocess.run([GPUSHARE, *args, "--help"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        for markup in ("``", "====", ".. code", ":ref:", "::\n"):
            assert markup not in done.stdout, (args, markup)
    top = subprocess.run([GPUSHARE, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "Exit codes:" in top and "120  the job was cancelled" in top


def test_gpus_3_5_is_one_clear_error(acme):
    url, token, tenant = acme
    done = run_cli(url, token, "submit", "--gpus", "3.5", "--", "python", "x.py")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.count("Error") == 1 and "3.5 is neither 1-8 whole GPUs nor a shared slice" in done.stderr
    training = run_cli(url, token, "submit", "--kind", "training", "--gpus", "0.5", "--", "x")
    assert training.returncode == EXIT_USAGE and "training job takes whole GPUs" in training.stderr
    with scopes_disabled():
        assert not Job.objects.filter(tenant=tenant).exists()


def test_shell_completion():
    script = subprocess.run([GPUSHARE, "completion", "bash"], capture_output=True, text=True, timeout=30)
    assert script.returncode == 0 and "_GPUSHARE_COMPLETE" in script.stdout
    env = {
        "PATH": "/usr/bin:/bin",
        "_GPUSHARE_COMPLETE": "bash_complete",
        "COMP_WORDS": "gpushare su",
        "COMP_CWORD": "1",
    }
    words = subprocess.run([GPUSHARE], env=env, capture_output=True, text=True, timeout=30).stdout
    assert "submit" in words
    env |= {"COMP_WORDS": "gpushare list --state ru", "COMP_CWORD": "3"}
    assert "running" in subprocess.run([GPUSHARE], env=env, capture_output=True, text=True, timeout=30).stdout


def test_array_flag_submits_a_job_array(acme):
    url, token, tenant = acme
    ranged = run_cli(url, token, "submit", "--array", "1-3", "-q", "--", "python", "sweep.py")
    assert ranged.returncode == 0, ranged.stderr
    with scopes_disabled():
        ids = sorted(Job.objects.filter(tenant=tenant).values_list("pk", flat=True))
    assert [int(line) for line in ranged.stdout.split()] == ids and len(ids) == 3  # the tasks' ids
    counted = run_cli(url, token, "submit", "--array", "5", "--", "python", "sweep.py")
    assert counted.returncode == 0 and "5 tasks" in counted.stdout, counted.stderr
    array_id = int(counted.stdout.split()[2])
    listed = run_cli(url, token, "list", "--array", str(array_id), "--json")
    assert len(json.loads(listed.stdout)["results"]) == 5


# --- run -------------------------------------------------------------------------------------------


class Running:
    """``gpushare run ...`` as a process whose stdout and stderr are read as they come."""

    def __init__(self, url: str, token: str, *args: str):
        env = {
            "PATH": "/usr/bin:/bin",
            "GPUSHARE_URL": url,
            "GPUSHARE_TOKEN": token,
            "GPUSHARE_POLL_INTERVAL": "0.3",
            "XDG_CONFIG_HOME": str(ROOT / "var" / "no-config"),
        }
        self.proc = subprocess.Popen(
            [GPUSHARE, "run", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, text: str, *, where: str = "out", timeout: float = 90) -> None:
        sink = self.out if where == "out" else self.err
        wait_for(lambda: text in "".join(sink) or self.proc.poll() is not None, timeout=timeout, what=text)
        assert text in "".join(sink), ("".join(self.out), "".join(self.err))

    def finish(self, timeout: float = 90) -> int:
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # the reader threads catch up
        return code


@pytest.mark.integration
def test_run_streams_the_output_and_exits_with_the_jobs_code(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="runner")
    token = token_for(tenant)
    script = (
        "import sys, time\nfor i in range(3):\n    print(f'tick {i}', flush=True)\n    time.sleep(1)\nsys.exit(3)\n"
    )
    running = Running(platform.url, token, "--gpus", "1", "--name", "one-step", "--", sys.executable, "-c", script)
    running.wait_for("tick 0\n")
    first_seen = time.monotonic()
    assert running.proc.poll() is None  # the first line arrived while the job still ran
    assert running.finish() == 3
    assert "".join(running.out) == "tick 0\ntick 1\ntick 2\n"
    assert time.monotonic() - first_seen >= 1.5
    stderr = "".join(running.err)
    assert "submitted" in stderr and "failed: exit code 3" in stderr
    ok = run_cli(platform.url, token, "run", "-q", "--gpus", "0.25", "--", sys.executable, "-c", "print('hi')")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "hi\n", "")


@pytest.mark.integration
def test_ctrl_c_cancels_the_job_and_a_second_ctrl_c_detaches(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="interrupted")
    token = token_for(tenant)
    script = "import time\nprint('started', flush=True)\ntime.sleep(300)\n"

    running = Running(platform.url, token, "--", sys.executable, "-c", script)
    running.wait_for("started\n")
    running.proc.send_signal(signal.SIGINT)
    running.wait_for("cancel requested", where="err")
    assert running.finish() == EXIT_CANCELLED, "".join(running.err)
    with scopes_disabled():
        job = Job.objects.filter(tenant=tenant).latest("pk")
    assert job.state == "cancelled"
    assert "Traceback" not in "".join(running.err)

    # Cancellation takes the class's grace period when the job ignores SIGTERM: a second Ctrl-C detaches.
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('started', flush=True)\n"
    stubborn += "time.sleep(300)\n"
    again = Running(platform.url, token, "--", sys.executable, "-c", stubborn)
    again.wait_for("started\n")
    again.proc.send_signal(signal.SIGINT)
    again.wait_for("cancel requested", where="err")
    again.proc.send_signal(signal.SIGINT)
    assert again.finish() == EXIT_INTERRUPTED
    assert "detached" in "".join(again.err) and "Traceback" not in "".join(again.err)
    with scopes_disabled():
        job = Job.objects.filter(tenant=tenant).latest("pk")
    assert job.stop_requested  # the first Ctrl-C's cancel stands; the CLI just stopped watching
