"""`make run` (scripts/run.py) on its embedded defaults prints one "gpushare is ready at ..."
line with the logins once every process answers, and nothing periodic afterwards at the
default log level; Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.processes import nft_tables

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent.parent
PERIODIC = re.compile(
    r"Sending due task|endpoints\.autoscale|scheduler\.pass|agents\.check_nodes|agents\.heartbeat|"
    r"scheduler\.launches_resend|admission\.budgets_enforce|No hostname was supplied"
)
QUIET_S = 30


def free_base() -> int:
    """A port P with P..P+4 and P+420 (localstripe) free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 420 > 65000:
            continue
        try:
            for port in (*range(base, base + 5), base + 420):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def test_make_run_prints_one_ready_line_and_no_periodic_noise(tmp_path):
    port = free_base()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(PORT=str(port), GPUSHARE_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1")
    env.pop("LOG_LEVEL", None)
    proc = subprocess.Popen(
        [sys.executable, "scripts/run.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 360
        ready_at = None
        while time.monotonic() < deadline and proc.poll() is None and ready_at is None:
            ready_at = next((t for t, line in lines if "gpushare is ready at" in line), None)
            time.sleep(0.5)
        assert ready_at is not None, "no ready line:\n" + "\n".join(line for _, line in lines[-60:])
        time.sleep(QUIET_S)
        output = [line for _, line in lines]
        ready = [line for line in output if "gpushare is ready at" in line]
        assert len(ready) == 1, ready
        logins = "logins: operator@gpushare.local / "
        assert ready[0].startswith(f"gpushare is ready at http://127.0.0.1:{port}/ , {logins}")
        assert "alice@acme.test" in ready[0] and "API token acme: gps_" in ready[0]
        after = [line for t, line in lines if t > ready_at + 1]
        noisy = [line for line in after if PERIODIC.search(line)]
        assert noisy == [], "\n".join(noisy)
        assert len(after) <= 5, "\n".join(after)  # quiet when nothing happens
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        reader.join(timeout=5)
    # Every process it started is gone (honcho ran them in its own process group).
    time.sleep(1)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left
    assert "gpushare_sim_node_1" not in nft_tables()  # as root the agent was multi-tenant: its rules are gone
