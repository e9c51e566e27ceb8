"""Fixtures for the tenant-isolation attacks: real multi-tenant agents (root, a
uid pool, nftables) running real jobs of two tenants.

Every test here needs root (uid switching, nftables): CI runs as root. Jobs
run Debian's ``/usr/bin/python3``, which every uid can execute (this venv's
interpreter lives under /root, which job uids cannot enter, as it should be).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from agents.agent.netpolicy import table_name
from tests.agents.conftest import unique_node_name
from tests.factories import wait_for

PY = "/usr/bin/python3"

if os.geteuid() != 0:  # pragma: no cover - CI and the dev machines run as root
    pytest.skip("tenant isolation needs root (uid switching, nftables)", allow_module_level=True)


def pool_uids(agent) -> tuple[int, int]:
    first, last = agent.argv[agent.argv.index("--uid-pool") + 1].split("-")
    return int(first), int(last)


def uid_processes(uid: int) -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]


@pytest.fixture
def work_root():
    """A work root every uid can traverse (pytest's tmp dirs are 0700, as they should be)."""
    root = Path(f"/tmp/gpushare-sec-{os.getpid()}-{random.randrange(1 << 30):x}")
    root.mkdir(mode=0o711)
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def secure_agent(agent_factory, work_root):
    """``secure_agent(pool_size=8, extra=[...])``: a multi-tenant agent with a uid pool of its own.

    On the way out: its nft table is gone (the agent deletes it; a killed one is
    cleaned here), no process runs as its pool uids, its work dirs are removed.
    """
    made = []

    def make(node: str = "", *, pool_size: int = 8, extra=(), wait: bool = True, pool: tuple[int, int] | None = None):
        node = node or unique_node_name()
        if pool is None:
            base = random.randrange(300_000, 2_000_000_000, 1000)
            pool = (base, base + pool_size - 1)
        argv = [
            "--tenancy",
            "multi",
            "--uid-pool",
            f"{pool[0]}-{pool[1]}",
            "--work-root",
            str(work_root / node),
            "--disk-check-interval",
            "0.5",
            *extra,
        ]
        agent = agent_factory(node, extra=argv, wait=wait)
        made.append((agent, pool))
        return agent

    yield make
    for agent, (first, last) in made:
        agent.stop()
        subprocess.run(["nft", "delete", "table", "inet", table_name(agent.node)], capture_output=True, check=False)
        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] and first <= proc.info["uids"].real <= last:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        for uid in range(first, last + 1):  # the pool's lock files (the agent keeps them: flock + unlink races)
            Path(f"/run/gpushare/uids/{uid}").unlink(missing_ok=True)


def nft_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout


def job_result(output: str, marker: str = "RESULT=") -> dict:
    line = next(line for line in output.splitlines() if line.startswith(marker))
    return json.loads(line[len(marker) :])


def run_as(uid: int, argv: list[str]) -> subprocess.Popen:
    """A process of the test's own as ``uid`` (something already holding a pool uid)."""

    def drop():
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    return subprocess.Popen(argv, preexec_fn=drop, start_new_session=True, cwd="/")


def wait_gone(path: Path, timeout: float = 30) -> None:
    wait_for(lambda: not path.exists(), timeout=timeout, what=f"{path} removed")


def sleep_briefly() -> None:
    time.sleep(0.3)
