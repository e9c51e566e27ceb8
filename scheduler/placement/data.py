"""The plain data the scheduling core reads and returns.

Units: GPU shares in thousandths (``1000`` is a whole GPU), GPU memory in MiB,
host CPU in thousandths of a core, times in integer milliseconds since the
epoch. Nothing here imports Django.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WHOLE = 1000
NEVER = math.inf  # a time that never comes (a GPU held by a job of unknown end)

ANY = "any"
DEDICATED_ONLY = "dedicated_only"
SHARED_ONLY = "shared_only"


@dataclass(eq=False)
class GpuSlot:
    uuid: str
    node: str
    model: str
    memory_mb: int
    used_milli: int = 0  # sum of the shares held on it
    used_memory_mb: int = 0  # GPU memory promised to slices on it
    dedicated: bool = False  # held whole by one job
    reservation: str = ANY  # any | dedicated_only | shared_only
    healthy: bool = True
    # (estimated end ms, share milli, job id) of every job holding it; filled by plan() from ``running``.
    holders: list[tuple[float, int, int]] = field(default_factory=list)
    # MIG mode: its instances as (memory MiB, profile name), e.g. (40192, "3g.40gb"); a slice runs in one
    # instance of its own (see ``mig_need``). ``None``: not in MIG mode. plan() takes the instances
    # running slices use (the smallest that holds each, as the agent picks) and keeps the rest in
    # ``mig_free``.
    mig: tuple[tuple[int, str], ...] | None = None
    mig_free: list[tuple[int, str]] = field(default_factory=list)

    @property
    def free_milli(self) -> int:
        return 0 if self.dedicated else WHOLE - self.used_milli

    @property
    def idle(self) -> bool:
        return not self.dedicated and self.used_milli == 0

    @property
    def shared(self) -> bool:
        return not self.dedicated and self.used_milli > 0


MIG_FIT = 0.9  # a MIG instance holds a slice with at least this much of the slice's memory (as the agent picks)


def mig_need(gpu: GpuSlot, share_milli: int) -> int:
    """MiB a MIG instance needs to hold a slice of ``share_milli`` of ``gpu``."""
    return int(gpu.memory_mb * share_milli / WHOLE * MIG_FIT)


def mig_take(gpu: GpuSlot, share_milli: int) -> tuple[int, str] | None:
    """Take the smallest free instance of ``gpu`` that holds the slice (None: none does)."""
    need = mig_need(gpu, share_milli)
    for i, instance in enumerate(gpu.mig_free):
        if instance[0] >= need:
            return gpu.mig_free.pop(i)
    return None


@dataclass(eq=False)
class NodeSlot:
    name: str
    gpus: list[GpuSlot] = field(default_factory=list)
    schedulable: bool = True
    # Host resources; 0 means "not tracked" (the platform meters GPUs only).
    cpu_milli: int = 0
    memory_mib: int = 0
    used_cpu_milli: int = 0
    used_memory_mib: int = 0

    def host_fits(self, cpu_milli: int, memory_mib: int) -> bool:
        if self.cpu_milli and cpu_milli and self.used_cpu_milli + cpu_milli > self.cpu_milli:
            return False
        return not (self.memory_mib and memory_mib and self.used_memory_mib + memory_mib > self.memory_mib)


@dataclass(frozen=True)
class Request:
    """A queued job, as the core sees it."""

    job_id: int
    tenant: str
    rank: int
    submitted_ms: int
    shared: bool
    count: int = 1  # whole GPUs when dedicated
    share_milli: int = WHOLE  # slice size when shared
    gpu_model: str = ""  # "" (any), one model, or alternatives "V100M16|V100M32"
    gpu_memory_mb: int = 0  # dedicated: at least this much per GPU; shared: reserved on the GPU
    max_runtime_ms: int = 0  # 0: the policy's default applies
    priority: str = ""  # the priority class's name (preemption rules are per class)
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def milli(self) -> int:
        """GPU thousandths the job holds once placed."""
        return self.share_milli if self.shared else self.count * WHOLE

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(m for m in self.gpu_model.split("|") if m) if self.gpu_model else ()

    def shape(self) -> tuple:
        """What placement depends on; requests of one shape fit (or not) in the same places."""
        return (
            self.shared,
            self.count,
            self.share_milli,
            self.gpu_model,
            self.gpu_memory_mb,
            self.cpu_milli,
            self.memory_mib,
        )


@dataclass(frozen=True)
class Running:
    """A job that holds GPUs now (scheduled or running)."""

    job_id: int
    tenant: str
    rank: int
    node: str
    gpu_uuids: tuple[str, ...]
    share_milli: int  # per GPU: 1000 when dedicated
    started_ms: int
    end_ms: float  # estimated: start + max runtime (NEVER when unknown)
    priority: str = ""
    preemptible: bool = False
    min_runtime_ms: int = 0
    gpu_memory_mb: int = 0  # reserved on its GPU (slices)
    stopping: bool = False  # already asked to stop (preempted, cancelled): its GPUs free up soon
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def milli(self) -> int:
        return self.share_milli * len(self.gpu_uuids)


@dataclass(frozen=True)
class Limits:
    """A tenant's concurrent caps; ``None`` means no cap."""

    dedicated_gpus: int | None = None
    shared_milli: int | None = None
    blocked_reason: str = ""  # e.g. "the monthly budget is spent": holds every job of the tenant


@dataclass
class Policy:
    """The operator's rules and the facts the core needs about the past."""

    now_ms: int = 0
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> fair-share weight (default 1)
    usage: dict[str, float] = field(default_factory=dict)  # tenant -> decayed usage, milli x ms
    half_life_ms: int = 7 * 24 * 3600 * 1000
    limits: dict[str, Limits] = field(default_factory=dict)
    may_preempt: dict[str, frozenset[str]] = field(default_factory=dict)  # class -> classes it may preempt
    backfill: bool = True
    default_max_runtime_ms: int = 24 * 3600 * 1000
    preempt_grace_ms: int = 30_000  # when a stopping job's GPUs are expected back
    # Placement score (see .score): price per GPU-hour of each model (cheapest fitting model first for a job
    # that names none; a missing model counts 0), and recent requests (any state) that give the workload's
    # mix of shapes, on top of the queue itself.
    model_price: dict[str, float] = field(default_factory=dict)
    recent: tuple[Request, ...] = ()
    # GPUs a move frees for a waiting job (see .defrag): GPU uuid -> that job's id. No one else may use them.
    claims: dict[str, int] = field(default_factory=dict)

    def runtime_ms(self, request: Request) -> int:
        return request.max_runtime_ms or self.default_max_runtime_ms


@dataclass(frozen=True)
class Placement:
    job_id: int
    node: str
    gpu_uuids: tuple[str, ...]
    share_milli: int


@dataclass(frozen=True)
class Preemption:
    victim_id: int
    for_job_id: int
    node: str


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    pending: dict[int, str] = field(default_factory=dict)  # job id -> why it waits
    preemptions: list[Preemption] = field(default_factory=list)
    estimated_start_ms: dict[int, int] = field(default_factory=dict)  # pending job id -> earliest start
    positions: dict[int, int] = field(default_factory=dict)  # job id -> 1-based place in the effective order
    blocked: list[int] = field(default_factory=list)  # jobs that wait on capacity (not limits), in queue order
    reserved: dict[str, int] = field(default_factory=dict)  # GPU uuid -> the waiting job it is promised to
