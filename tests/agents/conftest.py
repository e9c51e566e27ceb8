"""Fixtures for agent tests: the fake NVML library, agents running on it,
and small helpers to drive an agent directly through its node queue."""

from __future__ import annotations

import ctypes
import json
import sys
import uuid
from pathlib import Path

import pytest

from tests.factories import wait_for
from tests.fake_nvml import LIBRARY, FakeGpu, FakeNvml, build

GPU0 = "GPU-11111111-2222-3333-4444-000000000000"
GPU1 = "GPU-11111111-2222-3333-4444-000000000001"


def unique_node_name() -> str:
    """A node name of its own: agent logs (var/test-logs/agent-<node>.log) are appended across runs and
    shared with other test sessions, so a fixed name would let an old run's log satisfy a new assertion."""
    return f"ga-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def node() -> str:
    return unique_node_name()


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory) -> Path:
    """The fake libnvidia-ml.so.1, compiled once per session."""
    return build(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def fake_nvml(tmp_path) -> FakeNvml:
    """Two H100s, no processes; change it and ``save()`` while things run."""
    state = FakeNvml(
        path=tmp_path / "fake-nvml.conf",
        gpus=[
            FakeGpu(uuid=GPU0, power_mw=300_000, energy_mj=5_000_000, util=40),
            FakeGpu(uuid=GPU1, power_mw=100_000, energy_mj=1_000_000),
        ],
    )
    return state.save()


@pytest.fixture
def load_fake_nvml(fake_nvml, monkeypatch):
    """``load_fake_nvml(lib_dir=None)`` makes this process's pynvml use the fake.

    pynvml dlopens "libnvidia-ml.so.1" by name; LD_LIBRARY_PATH is read only when
    a process starts, so in-process tests hand pynvml the library by path
    (agent processes find it through LD_LIBRARY_PATH, the real way).
    """
    import pynvml

    monkeypatch.setenv("FAKE_NVML_CONFIG", str(fake_nvml.path))

    def load(lib_dir: Path | None = None):
        pynvml.nvmlLib = ctypes.CDLL(str(lib_dir / LIBRARY)) if lib_dir else None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        return pynvml

    yield load
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def nvml_agent(agent_factory, fake_nvml_dir, fake_nvml, monkeypatch):
    """``nvml_agent(name, extra=[...])``: an agent process on the fake NVML (``--gpus nvml``)."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_nvml_dir))
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(fake_nvml.path))

    def make(node: str = "", *, extra=()):
        return agent_factory(node or unique_node_name(), gpus="nvml", extra=list(extra))

    return make


def launch_direct(agent, job_id: int, command: list[str], *, gpu_uuids=(), share_milli=1000, **fields) -> dict:
    """Send ``agent.launch`` straight to the node's queue (no scheduler involved)."""
    from agents.dispatch import node_send

    payload = {
        "job_id": job_id,
        "attempt": 1,
        "tenant": "t",
        "command": command,
        "env": {},
        "image": "",
        "gpu_uuids": list(gpu_uuids),
        "share_milli": share_milli,
        "mode": "dedicated" if share_milli >= 1000 else "shared",
        "max_runtime_s": 600,
        "grace_s": 5,
        **fields,
    }
    node_send(agent.node, "agent.launch", payload)
    return payload


def job_dir(agent, job_id: int, attempt: int = 1) -> Path:
    """The attempt's work dir (``--work-root``, default ``<var-dir>/jobs/<node>``); removed when it ends."""
    argv = agent.argv
    root = Path(argv[argv.index("--work-root") + 1]) if "--work-root" in argv else agent.var_dir / "jobs" / agent.node
    return root / f"{job_id}-{attempt}"


def job_log(agent, job_id: int, attempt: int = 1) -> Path:
    """The attempt's output as the agent captured it (0600, in the agent's own state dir)."""
    return agent.var_dir / "agent" / agent.node / "logs" / f"{job_id}-{attempt}.log"


def job_output(agent, job_id: int, attempt: int = 1) -> str:
    path = job_log(agent, job_id, attempt)
    return path.read_text(errors="replace") if path.exists() else ""


def wait_output(agent, job_id: int, marker: str, *, timeout: float = 45, attempt: int = 1) -> str:
    return wait_for(
        lambda: (out := job_output(agent, job_id, attempt)) and marker in out and out,
        timeout=timeout,
        what=f"{marker!r} in job {job_id}'s output (agent log: {agent.log()[-1500:]})",
    )


def env_dump_command(marker: str = "ENV=") -> list[str]:
    """A job that prints its whole environment as one JSON line, then exits."""
    return [sys.executable, "-c", f"import json, os; print({marker!r} + json.dumps(dict(os.environ)))"]


def parse_env_dump(output: str, marker: str = "ENV=") -> dict:
    line = next(line for line in output.splitlines() if line.startswith(marker))
    return json.loads(line[len(marker) :])
