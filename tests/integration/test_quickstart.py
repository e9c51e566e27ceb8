"""The README's Quick start, verbatim: `make run`'s script on a fresh var/ and another port,
then the README's shell block run by bash as a newcomer would paste it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.processes import nft_tables

ROOT = Path(__file__).resolve().parents[2]


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"<!-- quickstart -->\n```sh\n(.*?)```", text, re.S).group(1)


def free_port() -> int:
    """A port P with P+1 (the gateway), P+2..P+4 (agent, worker, beat health ports) and P+420 (localstripe) free too."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 420 > 65535:
            continue
        try:
            for other in (port + 1, port + 2, port + 3, port + 4, port + 420):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", other))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port triple")


@pytest.mark.integration
def test_the_readme_quick_start_works_verbatim(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env |= {"PORT": str(port), "GPUSHARE_VAR_DIR": str(tmp_path / "var"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "make-run.log", "wb")
    run = subprocess.Popen(
        [sys.executable, "scripts/run.py"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "make-run.log").read_text()[-3000:]
            try:
                up = requests.get(f"http://127.0.0.1:{port}/accounts/login/", timeout=2).status_code == 200
                gateway = socket.create_connection(("127.0.0.1", port + 1), timeout=1)
                gateway.close()
            except (requests.RequestException, OSError):
                up = False
            if up and (tmp_path / "var" / "demo.json").exists():
                break
            time.sleep(1)
        else:
            raise AssertionError("make run did not come up: " + (tmp_path / "make-run.log").read_text()[-3000:])
        time.sleep(3)  # the agent registers its node

        # The README block as it is, from a shell whose current directory holds var/demo.json.
        shell = subprocess.run(
            ["bash", "-e", "-c", readme_block()],
            cwd=tmp_path,
            env={"PATH": os.environ["PATH"], "PORT": str(port), "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert shell.returncode == 0, (shell.stdout, shell.stderr, (tmp_path / "make-run.log").read_text()[-3000:])
        job_json, logs_json, echo_json = shell.stdout.strip().splitlines()[-3:]
        job = json.loads(job_json)
        assert job["state"] == "succeeded" and job["gpu_uuids"], job
        assert json.loads(logs_json)["data"].strip() == job["gpu_uuids"][0]  # the job saw its GPU
        assert json.loads(echo_json) == {"model": "echo", "echo": "hello"}  # through the gateway, from zero
    finally:
        try:
            os.killpg(run.pid, signal.SIGTERM)
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
        except ProcessLookupError:
            pass
        log.close()
    assert "gpushare_sim_node_1" not in nft_tables()  # the agent removed its rules on the way out
