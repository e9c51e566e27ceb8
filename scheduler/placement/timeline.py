"""When could a request start, from the estimated ends of the jobs that hold GPUs now.

Used for the head of the queue's backfill reservation (its *shadow time*),
for the estimated start shown to users, and to see whether a job only waits
for preempted jobs that are already stopping.
"""

from __future__ import annotations

from .data import DEDICATED_ONLY, NEVER, SHARED_ONLY, WHOLE, GpuSlot, NodeSlot, Request
from .fleet import Fleet, slice_memory


def earliest_start(
    fleet: Fleet, request: Request, *, now_ms: int, stopping_end: dict[int, float], skip_reserved: bool = True
) -> tuple[float, list[GpuSlot]] | None:
    """Earliest time the request fits if nothing else is placed first, and where.

    ``stopping_end`` gives the expected exit of jobs already asked to stop;
    other jobs end at their estimated end, and never before ``now_ms + 1``
    (a job past its estimate is still running now). Reserved GPUs are skipped
    unless ``skip_reserved`` is false.
    """

    def ends_at(end: float, job_id: int) -> float:
        stop = stopping_end.get(job_id)
        return stop if stop is not None else max(end, now_ms + 1)

    def idle_at(gpu: GpuSlot) -> float:
        if gpu.idle:
            return now_ms
        if not gpu.holders:
            return NEVER
        return max(ends_at(end, job) for end, _, job in gpu.holders)

    models = set(fleet.models_for(request))
    reserved = fleet.reserved if skip_reserved else {}
    best: tuple[float, list[GpuSlot]] | None = None
    for node in fleet.nodes.values():
        if not node.schedulable or (node.cpu_milli and node.cpu_milli < request.cpu_milli):
            continue
        if request.shared:
            for gpu in node.gpus:
                if gpu.model not in models or not gpu.healthy or gpu.reservation == DEDICATED_ONLY:
                    continue
                if gpu.uuid in reserved or gpu.memory_mb < slice_memory(gpu, request):
                    continue
                at = _slice_free_at(gpu, request, now_ms, idle_at, ends_at)
                if best is None or at < best[0]:
                    best = (at, [gpu])
            continue
        by_model: dict[str, list[tuple[float, GpuSlot]]] = {}
        for gpu in node.gpus:
            if gpu.model not in models or not gpu.healthy or gpu.reservation == SHARED_ONLY:
                continue
            if gpu.uuid in reserved or gpu.memory_mb < request.gpu_memory_mb:
                continue
            by_model.setdefault(gpu.model, []).append((idle_at(gpu), gpu))
        for times in by_model.values():
            if len(times) < request.count:
                continue
            times.sort(key=lambda t: t[0])
            at = times[request.count - 1][0]
            if best is None or at < best[0]:
                best = (at, [g for _, g in times[: request.count]])
    if best is None or best[0] == NEVER:
        return None
    return best


def _slice_free_at(gpu: GpuSlot, request: Request, now_ms: int, idle_at, ends_at) -> float:
    if gpu.dedicated or not gpu.holders:
        return idle_at(gpu)
    free = WHOLE - gpu.used_milli
    free_memory = gpu.memory_mb - gpu.used_memory_mb
    need_memory = slice_memory(gpu, request)
    if free >= request.share_milli and free_memory >= need_memory:
        return now_ms
    at = float(now_ms)
    for end, milli, job in sorted(gpu.holders, key=lambda h: ends_at(h[0], h[2])):
        at = ends_at(end, job)
        free += milli
        free_memory += milli * gpu.memory_mb // WHOLE  # slices' memory is roughly their share
        if free >= request.share_milli and free_memory >= need_memory:
            return at
    return idle_at(gpu)


class Timeline:
    """Earliest starts for many requests at once (the estimates shown to users).

    Built once from the fleet after a pass's placements: each GPU's time to be
    idle is computed once, and each node's idle times per model are sorted once,
    so an estimate costs one look per node (dedicated) or per GPU (slices).
    Reservations are ignored: an estimate is the earliest the capacity exists.
    """

    def __init__(self, fleet: Fleet, *, now_ms: int, stopping_end: dict[int, float]):
        self.fleet = fleet
        self.now = now_ms
        self.stopping_end = stopping_end
        # model -> [(node, sorted idle times of its GPUs open to dedicated use, their smallest memory)]
        self.nodes_by_model: dict[str, list[tuple[NodeSlot, list[float], int]]] = {}
        self.slices_by_model: dict[str, list[GpuSlot]] = {}
        self.idle: dict[str, float] = {}
        for node in fleet.nodes.values():
            if not node.schedulable:
                continue
            per_model: dict[str, list[tuple[float, int]]] = {}
            for gpu in node.gpus:
                if not gpu.healthy:
                    continue
                at = self._idle_at(gpu)
                self.idle[gpu.uuid] = at
                if gpu.reservation != SHARED_ONLY:
                    per_model.setdefault(gpu.model, []).append((at, gpu.memory_mb))
                if gpu.reservation != DEDICATED_ONLY:
                    self.slices_by_model.setdefault(gpu.model, []).append(gpu)
            for model, times in per_model.items():
                times.sort()
                self.nodes_by_model.setdefault(model, []).append(
                    (node, [t for t, _ in times], min(m for _, m in times))
                )

    def _ends(self, end: float, job_id: int) -> float:
        stop = self.stopping_end.get(job_id)
        return stop if stop is not None else max(end, self.now + 1)

    def _idle_at(self, gpu: GpuSlot) -> float:
        if gpu.idle:
            return self.now
        if not gpu.holders:
            return NEVER
        return max(self._ends(end, job) for end, _, job in gpu.holders)

    def earliest(self, request: Request) -> float | None:
        best = NEVER
        for model in self.fleet.models_for(request):
            if request.shared:
                for gpu in self.slices_by_model.get(model, ()):
                    if gpu.memory_mb < slice_memory(gpu, request):
                        continue
                    at = _slice_free_at(gpu, request, self.now, lambda g: self.idle[g.uuid], self._ends)
                    if at < best:
                        best = at
                        if at <= self.now:
                            return at
                continue
            for node, times, memory in self.nodes_by_model.get(model, ()):
                if len(times) < request.count or (node.cpu_milli and node.cpu_milli < request.cpu_milli):
                    continue
                if memory < request.gpu_memory_mb:
                    fits = [
                        t
                        for t, g in zip(times, self._node_gpus(node, model), strict=True)
                        if g.memory_mb >= request.gpu_memory_mb
                    ]
                    if len(fits) < request.count:
                        continue
                    at = fits[request.count - 1]
                else:
                    at = times[request.count - 1]
                best = min(best, at)
        return None if best == NEVER else best

    def _node_gpus(self, node, model: str) -> list[GpuSlot]:
        gpus = [g for g in node.gpus if g.healthy and g.model == model and g.reservation != SHARED_ONLY]
        return sorted(gpus, key=lambda g: self.idle[g.uuid])
