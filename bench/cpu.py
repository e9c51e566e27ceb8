"""Where a benchmark's CPU went: the whole machine's busy time, and our stack's processes one by one.

A submit rate on a 2-core machine is bounded by the CPU each submit costs, all processes together
(client, web, database, broker, workers). ``Meter`` takes that before and after a timed run:
``machine`` from ``/proc/stat`` (every process and the kernel: Slurm's daemons, munge and sbatch
included), and, for the groups a system names, their processes' own times. What the groups do not
cover is ``other`` (the kernel's network stack, the agent, beat, short-lived processes).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds every core spent on anything but idle and I/O wait, since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) * TICK_S


def self_cpu_s() -> float:
    """This process's CPU seconds (the benchmark's clients run in it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def processes_cpu_s(processes: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds of each process still running, by pid."""
    out = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[process.pid] = times.user + times.system
    return out


def spent_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes running at both ends spent in between (one that ended during the run, a
    database session closed, say, is left out: its time is in ``other``)."""
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def named(prefix: str) -> list[psutil.Process]:
    """Every process whose name starts with ``prefix`` (PostgreSQL's backends: "postgres")."""
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith(prefix)]


Groups = Callable[[], dict[str, list[psutil.Process]]]


@dataclass
class Meter:
    """CPU per operation over one timed run: ``start()``, the run, ``stop(n)``."""

    groups: Groups = dict
    _machine: float = 0.0
    _client: float = 0.0
    _procs: dict[str, list[psutil.Process]] = field(default_factory=dict)
    _before: dict[str, dict[int, float]] = field(default_factory=dict)

    def start(self) -> None:
        self._procs = self.groups()  # the processes as they are when the run starts
        self._before = {name: processes_cpu_s(procs) for name, procs in self._procs.items()}
        self._client = self_cpu_s()
        self._machine = machine_busy_s()

    def stop(self, n: int) -> dict[str, float]:
        """Milliseconds of CPU per operation: ``machine`` (all of it), ``client``, each group, ``other``."""
        machine = machine_busy_s() - self._machine
        out = {"client": self_cpu_s() - self._client}
        for name, procs in self._procs.items():
            out[name] = spent_s(self._before[name], processes_cpu_s(procs))
        out["other"] = max(0.0, machine - sum(out.values()))
        out["machine"] = machine
        return {key: round(seconds * 1000 / max(1, n), 3) for key, seconds in out.items()}
