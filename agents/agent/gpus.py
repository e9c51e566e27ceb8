"""GPU backends for the node agent: what GPUs there are and what jobs do on them.

Two backends share one interface:

* :class:`agents.agent.nvml.NvmlBackend` reads a real NVIDIA driver through
  ``pynvml`` (nvidia-ml-py);
* :class:`SimBackend` simulates GPUs for machines without any, with figures
  taken from the job processes' real CPU time and resident memory, so a busy
  job and an idle job meter differently.
"""

from __future__ import annotations

import re
import time
import uuid as uuidlib
from dataclasses import dataclass, field

import psutil

# Nominal figures for simulated models: memory (MiB), idle and max power (W).
SIM_MODELS = {
    "H100-80GB": (81_559, 70, 700),
    "H200-141GB": (143_771, 75, 700),
    "A100-80GB": (81_920, 55, 400),
    "A100-40GB": (40_960, 50, 400),
    "L4-24GB": (23_034, 16, 72),
    "T4-16GB": (15_360, 10, 70),
}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    model: str
    memory_mb: int
    mig_mode: bool = False
    isolation: str = "none"  # what a shared slice on it gets: mig | mps | none
    mig_instances: tuple[dict, ...] = ()  # MIG mode: [{uuid, memory_mb, gpu_instance_id}]

    def as_dict(self) -> dict:
        return {
            "mig_instances": [dict(i) for i in self.mig_instances],
            "index": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "memory_mb": self.memory_mb,
            "mig_mode": self.mig_mode,
            "isolation": self.isolation,
        }


def mig_profile(instance_mb: int, gpu_mb: int) -> str:
    """NVIDIA's name for a MIG instance of ``instance_mb`` on a GPU of ``gpu_mb``: compute slices and
    nominal memory, e.g. "3g.40gb" for half of an 80 GB card (1/8: 1g, 1/4: 2g, 1/2: 3g, all: 7g)."""
    if gpu_mb <= 0 or instance_mb <= 0:
        return ""
    eighths = max(1, min(8, round(8 * instance_mb / gpu_mb)))
    nominal = max(8, round(gpu_mb / 1024 / 8) * 8)  # 81,559 MiB -> 80 GB
    compute = {1: 1, 2: 2, 3: 3, 4: 3, 5: 4, 6: 4, 7: 4, 8: 7}[eighths]
    return f"{compute}g.{nominal * eighths // 8}gb"


def mig_layout(gpu: dict) -> list[dict]:
    """A registered GPU's MIG instances as the platform keeps them: uuid, memory and profile, smallest
    first ([] when the GPU is not in MIG mode or reports none)."""
    if not gpu.get("mig_mode"):
        return []
    out = []
    for instance in gpu.get("mig_instances") or []:
        try:
            memory = int(instance.get("memory_mb") or 0)
            uuid = str(instance.get("uuid") or "")[:96]
        except (AttributeError, TypeError, ValueError):
            continue
        if memory > 0 and uuid:
            out.append({"uuid": uuid, "memory_mb": memory, "profile": mig_profile(memory, int(gpu["memory_mb"]))})
    return sorted(out, key=lambda i: (i["memory_mb"], i["uuid"]))


@dataclass
class JobUse:
    """What one job did on one GPU since the previous sample."""

    sm_util: float = 0.0  # percent of the whole GPU's SMs
    memory_mb: int = 0


@dataclass
class GpuSample:
    uuid: str
    util: float | None = None  # percent
    memory_used_mb: int | None = None
    power_w: float | None = None
    energy_mj: int | None = None  # cumulative since some start; take deltas
    temperature_c: int | None = None
    jobs: dict[int, JobUse] = field(default_factory=dict)  # job id -> use
    health_events: list[dict] = field(default_factory=list)

    def metrics(self) -> dict:
        return {
            "util": self.util,
            "memory_used_mb": self.memory_used_mb,
            "power_w": self.power_w,
            "temperature_c": self.temperature_c,
            # Each job's own latest use (the portal's live charts; a slice sees only its own).
            "jobs": {str(job_id): {"sm_util": u.sm_util, "memory_mb": u.memory_mb} for job_id, u in self.jobs.items()},
        }


@dataclass(frozen=True)
class JobProcesses:
    """The processes of one job, as the backend needs them."""

    job_id: int
    gpu_uuids: tuple[str, ...]
    pids: frozenset[int]
    share_milli: int


def parse_sim_spec(spec: str) -> list[tuple[str, int]]:
    """``sim:2xH100-80GB,2xL4-24GB`` -> [("H100-80GB", 81559), ...] (one per GPU)."""
    body = spec.removeprefix("sim:")
    gpus: list[tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in body.split(","))):
        match = re.fullmatch(r"(?:(\d+)x)?([A-Za-z0-9][\w.-]*?)(?::(\d+))?", part)
        if not match:
            raise ValueError(f"bad GPU spec {part!r}: expected e.g. 2xH100-80GB or 1xMyGPU:16384")
        count, model, memory = int(match.group(1) or 1), match.group(2), match.group(3)
        if memory is None:
            if model not in SIM_MODELS:
                known = ", ".join(SIM_MODELS)
                raise ValueError(f"unknown simulated model {model!r}; known: {known} (or give MODEL:MEMORY_MB)")
            memory_mb = SIM_MODELS[model][0]
        else:
            memory_mb = int(memory)
        if not 1 <= count <= 64:
            raise ValueError(f"{part!r}: between 1 and 64 GPUs of a kind")
        gpus.extend([(model, memory_mb)] * count)
    if not gpus:
        raise ValueError("no GPUs in the simulated spec")
    return gpus


class SimBackend:
    """Simulated GPUs whose figures come from the jobs' real CPU time and RSS.

    A job's SM utilisation on each of its GPUs is its process tree's CPU use
    (one fully busy core = 100%), scaled to its slice for a shared GPU; its GPU
    memory is the tree's resident memory. Power follows utilisation between
    the model's idle and maximum, and energy integrates power.
    """

    name = "sim"

    def __init__(self, spec: str, node_name: str):
        self._gpus = [
            GpuInfo(
                index=i,
                uuid=f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{node_name}.{i}.gpushare.sim')}",
                model=model,
                memory_mb=memory_mb,
                isolation="none",
            )
            for i, (model, memory_mb) in enumerate(parse_sim_spec(spec))
        ]
        self._cpu_prev: dict[int, float] = {}
        self._energy: dict[str, float] = {g.uuid: 0.0 for g in self._gpus}
        self._last = time.monotonic()

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def versions(self) -> dict:
        return {"driver_version": "sim", "cuda_version": "sim"}

    def sample(self, jobs: list[JobProcesses]) -> dict[str, GpuSample]:
        now = time.monotonic()
        dt = max(now - self._last, 1e-3)
        self._last = now
        samples = {g.uuid: GpuSample(uuid=g.uuid, util=0.0, memory_used_mb=0, temperature_c=35) for g in self._gpus}
        seen: set[int] = set()
        for job in jobs:
            cpu_s, rss = 0.0, 0
            for pid in job.pids:
                try:
                    proc = psutil.Process(pid)
                    times = proc.cpu_times()
                    rss += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                total = times.user + times.system
                cpu_s += max(0.0, total - self._cpu_prev.get(pid, total))
                self._cpu_prev[pid] = total
                seen.add(pid)
            busy = min(100.0, 100.0 * cpu_s / dt)
            share = job.share_milli / 1000
            util = busy * share if share < 1 else busy
            memory_mb = rss // (1 << 20)
            per_gpu_memory = memory_mb // max(1, len(job.gpu_uuids))
            for uuid in job.gpu_uuids:
                if uuid in samples:
                    s = samples[uuid]
                    s.jobs[job.job_id] = JobUse(sm_util=util, memory_mb=per_gpu_memory)
                    s.util = min(100.0, (s.util or 0) + util)
                    s.memory_used_mb = (s.memory_used_mb or 0) + per_gpu_memory
        self._cpu_prev = {pid: v for pid, v in self._cpu_prev.items() if pid in seen}
        for gpu in self._gpus:
            s = samples[gpu.uuid]
            idle_w, max_w = SIM_MODELS.get(gpu.model, (0, 50, 300))[1:]
            s.power_w = idle_w + (max_w - idle_w) * (s.util or 0) / 100
            self._energy[gpu.uuid] += s.power_w * dt * 1000
            s.energy_mj = int(self._energy[gpu.uuid])
            s.temperature_c = int(35 + 40 * (s.util or 0) / 100)
        return samples

    def pids_on_gpu(self, uuid: str) -> set[int] | None:
        """PIDs the driver sees on ``uuid``; None when the backend cannot tell."""
        return None

    def close(self) -> None:
        pass
