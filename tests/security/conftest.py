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
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from agents.agent.cgroups import unified_mount
from agents.agent.netpolicy import table_name
from tests.agents.conftest import fake_nvml, fake_nvml_dir, unique_node_name  # noqa: F401 - shared fixtures
from tests.factories import wait_for
from tests.security.fake_engine import cgroup_tree_remove, engine_install

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

    def make(
        node: str = "",
        *,
        pool_size: int = 8,
        extra=(),
        wait: bool = True,
        pool: tuple[int, int] | None = None,
        gpus: str = "sim:2xH100-80GB,2xL4-24GB",
    ):
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
        agent = agent_factory(node, gpus=gpus, extra=argv, wait=wait)
        made.append((agent, pool))
        return agent

    yield make
    for agent, (first, last) in made:
        agent.stop()
        if shutil.which("nft"):  # an agent run with --network-policy off on a host without nftables made none
            subprocess.run(["nft", "delete", "table", "inet", table_name(agent.node)], capture_output=True, check=False)
        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] and first <= proc.info["uids"].real <= last:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        for uid in range(first, last + 1):  # the pool's lock files (the agent keeps them: flock + unlink races)
            Path(f"/run/gpushare/uids/{uid}").unlink(missing_ok=True)


@dataclass(frozen=True)
class Engine:
    docker: Path  # the stand-in CLI
    state: Path  # what it recorded: <container>.cgroup, <container>.argv
    default_parent: Path  # where its containers go without --cgroup-parent (docker's "/docker")

    def container_cgroup(self, name: str) -> Path:
        return Path((self.state / f"{name}.cgroup").read_text())


@pytest.fixture
def cgroup_mount() -> Path:
    mount = unified_mount()
    assert mount is not None, "this host has no cgroup v2 hierarchy"
    return mount


@pytest.fixture
def engine(tmp_path, cgroup_mount):
    """A container engine stand-in (cgroupfs driver) for ``--docker`` (``fake_engine.py``)."""
    state = tmp_path / "engine"
    state.mkdir(mode=0o700)
    default_parent = f"/gs-engine-{os.getpid()}-{random.randrange(1 << 30):x}"
    docker = engine_install(path=tmp_path / "docker", mount=cgroup_mount, default_parent=default_parent, state=state)
    yield Engine(docker=docker, state=state, default_parent=cgroup_mount / default_parent.lstrip("/"))
    cgroup_tree_remove(cgroup_mount / default_parent.lstrip("/"))


@pytest.fixture
def jobs_cgroup(cgroup_mount):
    """A cgroup v2 directory for ``--cgroup-root`` (request it before ``secure_agent``: removed after the agent)."""
    path = cgroup_mount / f"gs-jobs-{os.getpid()}-{random.randrange(1 << 30):x}"
    yield path
    cgroup_tree_remove(path)


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
