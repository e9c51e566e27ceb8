"""The pure scheduling core: plain data in, decisions out. No Django, no Celery.

Units: GPU shares in thousandths (``1000`` is a whole GPU), memory in MiB,
times in integer milliseconds.

This module decides *where* queued jobs go given the fleet's free capacity;
the service layer (``scheduler.services``) reads the state from the database,
calls :func:`plan`, and writes the decisions in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WHOLE = 1000


@dataclass
class GpuSlot:
    uuid: str
    node: str
    model: str
    memory_mb: int
    used_milli: int = 0  # sum of the shares held on it
    dedicated: bool = False  # held whole by one job
    reservation: str = "any"  # any | dedicated_only | shared_only
    healthy: bool = True

    @property
    def free_milli(self) -> int:
        return 0 if self.dedicated else WHOLE - self.used_milli

    @property
    def idle(self) -> bool:
        return not self.dedicated and self.used_milli == 0

    @property
    def shared(self) -> bool:
        return not self.dedicated and self.used_milli > 0


@dataclass
class NodeSlot:
    name: str
    gpus: list[GpuSlot] = field(default_factory=list)
    schedulable: bool = True


@dataclass(frozen=True)
class Request:
    job_id: int
    tenant: str
    rank: int
    submitted_ms: int
    shared: bool
    count: int = 1  # whole GPUs when dedicated
    share_milli: int = WHOLE  # slice size when shared
    gpu_model: str = ""
    gpu_memory_mb: int = 0


@dataclass(frozen=True)
class Placement:
    job_id: int
    node: str
    gpu_uuids: tuple[str, ...]
    share_milli: int


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    pending: dict[int, str] = field(default_factory=dict)  # job id -> reason


def queue_order(requests: list[Request]) -> list[Request]:
    """Higher rank first, then earlier submission, then lower id."""
    return sorted(requests, key=lambda r: (-r.rank, r.submitted_ms, r.job_id))


def _gpu_fits_model(gpu: GpuSlot, request: Request) -> bool:
    if request.gpu_model and gpu.model != request.gpu_model:
        return False
    if request.gpu_memory_mb and gpu.memory_mb < request.gpu_memory_mb:
        return False
    return gpu.healthy


def place_dedicated(nodes: list[NodeSlot], request: Request) -> Placement | None:
    """Gang placement: ``count`` idle GPUs on one node, best fit by node."""
    best: tuple[int, NodeSlot, list[GpuSlot]] | None = None
    for node in nodes:
        if not node.schedulable:
            continue
        idle = [
            g for g in node.gpus if g.idle and g.reservation != "shared_only" and _gpu_fits_model(g, request)
        ]
        if len(idle) < request.count:
            continue
        if best is None or len(idle) < best[0]:
            best = (len(idle), node, idle)
            if len(idle) == request.count:
                break
    if best is None:
        return None
    _, node, idle = best
    chosen = idle[: request.count]
    for gpu in chosen:
        gpu.dedicated = True
        gpu.used_milli = WHOLE
    return Placement(request.job_id, node.name, tuple(g.uuid for g in chosen), WHOLE)


def place_shared(nodes: list[NodeSlot], request: Request) -> Placement | None:
    """Best fit onto a GPU already shared; open an idle GPU only when none fits."""
    best: GpuSlot | None = None
    first_idle: GpuSlot | None = None
    for node in nodes:
        if not node.schedulable:
            continue
        for gpu in node.gpus:
            if gpu.reservation == "dedicated_only" or not _gpu_fits_model(gpu, request):
                continue
            if gpu.shared and gpu.free_milli >= request.share_milli:
                if best is None or gpu.free_milli < best.free_milli:
                    best = gpu
                    if gpu.free_milli == request.share_milli:
                        break
            elif gpu.idle and first_idle is None:
                first_idle = gpu
        if best is not None and best.free_milli == request.share_milli:
            break
    target = best or first_idle
    if target is None:
        return None
    target.used_milli += request.share_milli
    return Placement(request.job_id, target.node, (target.uuid,), request.share_milli)


def pending_reason(nodes: list[NodeSlot], request: Request) -> str:
    """Say, in words a user understands, why ``request`` cannot start now."""
    candidates = [g for n in nodes if n.schedulable for g in n.gpus if _gpu_fits_model(g, request)]
    if not candidates:
        if request.gpu_model:
            return f"no schedulable GPU of model {request.gpu_model} in the fleet"
        return "no schedulable GPU in the fleet"
    if not request.shared:
        per_node: dict[str, int] = {}
        for gpu in candidates:
            per_node[gpu.node] = per_node.get(gpu.node, 0) + 1
        if max(per_node.values()) < request.count:
            return f"no node has {request.count} GPUs of the requested kind"
        return f"waiting for {request.count} free whole GPU(s) on one node"
    return f"waiting for {request.share_milli / WHOLE:g} of a GPU to free up"


def plan(nodes: list[NodeSlot], requests: list[Request]) -> Plan:
    """Place as many queued requests as fit, in queue order (mutates ``nodes``)."""
    result = Plan()
    for request in queue_order(requests):
        placement = place_shared(nodes, request) if request.shared else place_dedicated(nodes, request)
        if placement is None:
            result.pending[request.job_id] = pending_reason(nodes, request)
        else:
            result.placements.append(placement)
    return result
