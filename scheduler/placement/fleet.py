"""Indexes over the fleet's free capacity, so that one placement decision costs
about the same on 100 nodes as on 5,000.

- idle GPUs, per model, grouped by node and bucketed by how many idle GPUs the
  node has (best fit: the node with the fewest that still fits); one index for
  dedicated use and one for opening a GPU to slices (reservations differ);
- GPUs already shared with room left, per model, bucketed by free thousandths
  (best fit: the least room that still fits).

A GPU is in an index only while its node is schedulable and it is healthy.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from .data import DEDICATED_ONLY, SHARED_ONLY, WHOLE, GpuSlot, NodeSlot, Request


class _IdleIndex:
    """model -> node -> idle GPUs; model -> [count] -> nodes with that many."""

    def __init__(self, width: int):
        self.width = width
        self.gpus: dict[str, dict[str, dict[str, GpuSlot]]] = {}
        self.buckets: dict[str, list[dict[str, NodeSlot]]] = {}

    def add(self, gpu: GpuSlot, node: NodeSlot) -> None:
        per_node = self.gpus.setdefault(gpu.model, {}).setdefault(node.name, {})
        buckets = self.buckets.setdefault(gpu.model, [{} for _ in range(self.width + 1)])
        count = len(per_node)
        if count:
            del buckets[count][node.name]
        per_node[gpu.uuid] = gpu
        buckets[count + 1][node.name] = node

    def remove(self, gpu: GpuSlot, node: NodeSlot) -> None:
        per_node = self.gpus.get(gpu.model, {}).get(node.name)
        if not per_node or gpu.uuid not in per_node:
            return
        buckets = self.buckets[gpu.model]
        count = len(per_node)
        del buckets[count][node.name]
        del per_node[gpu.uuid]
        if count > 1:
            buckets[count - 1][node.name] = node


class Fleet:
    def __init__(self, nodes: list[NodeSlot]):
        self.nodes = {n.name: n for n in nodes}
        self.gpus: dict[str, GpuSlot] = {}
        self.model_memory: dict[str, int] = {}  # model -> largest memory of a GPU of it
        width = max((len(n.gpus) for n in nodes), default=0)
        self.idle_dedicated = _IdleIndex(width)
        self.idle_shared = _IdleIndex(width)
        self.room: dict[str, dict[int, dict[str, GpuSlot]]] = {}
        self.room_keys: dict[str, list[int]] = {}
        # Backfill and preemption reservations: GPU uuid -> the time from which
        # it is promised to a job; only requests ending by then may use it.
        self.reserved: dict[str, float] = {}
        for node in nodes:
            for gpu in node.gpus:
                self.gpus[gpu.uuid] = gpu
                if not (node.schedulable and gpu.healthy):
                    continue
                self.model_memory[gpu.model] = max(self.model_memory.get(gpu.model, 0), gpu.memory_mb)
                if gpu.idle:
                    self._idle_add(gpu, node)
                elif gpu.shared:
                    self._room_put(gpu)

    # -- index upkeep ----------------------------------------------------------
    def _idle_add(self, gpu: GpuSlot, node: NodeSlot) -> None:
        if gpu.reservation != SHARED_ONLY:
            self.idle_dedicated.add(gpu, node)
        if gpu.reservation != DEDICATED_ONLY:
            self.idle_shared.add(gpu, node)

    def _idle_remove(self, gpu: GpuSlot, node: NodeSlot) -> None:
        self.idle_dedicated.remove(gpu, node)
        self.idle_shared.remove(gpu, node)

    def _room_put(self, gpu: GpuSlot) -> None:
        free = gpu.free_milli
        if free <= 0 or gpu.reservation == DEDICATED_ONLY:
            return
        buckets = self.room.setdefault(gpu.model, {})
        bucket = buckets.get(free)
        if bucket is None:
            bucket = buckets[free] = {}
            insort(self.room_keys.setdefault(gpu.model, []), free)
        bucket[gpu.uuid] = gpu

    def _room_drop(self, gpu: GpuSlot) -> None:
        buckets = self.room.get(gpu.model)
        bucket = buckets.get(gpu.free_milli) if buckets else None
        if not bucket or gpu.uuid not in bucket:
            return
        del bucket[gpu.uuid]
        if not bucket:
            del buckets[gpu.free_milli]
            keys = self.room_keys[gpu.model]
            del keys[bisect_left(keys, gpu.free_milli)]

    # -- changes ---------------------------------------------------------------
    def take_whole(self, node: NodeSlot, gpus: list[GpuSlot], request: Request) -> None:
        for gpu in gpus:
            self._idle_remove(gpu, node)
            gpu.dedicated = True
            gpu.used_milli = WHOLE
        node.used_cpu_milli += request.cpu_milli
        node.used_memory_mib += request.memory_mib

    def take_share(self, gpu: GpuSlot, request: Request) -> None:
        node = self.nodes[gpu.node]
        if gpu.idle:
            self._idle_remove(gpu, node)
        else:
            self._room_drop(gpu)
        gpu.used_milli += request.share_milli
        gpu.used_memory_mb += slice_memory(gpu, request)
        node.used_cpu_milli += request.cpu_milli
        node.used_memory_mib += request.memory_mib
        self._room_put(gpu)

    # -- questions -------------------------------------------------------------
    def models_for(self, request: Request) -> list[str]:
        wanted = request.models
        models = [m for m in wanted if m in self.model_memory] if wanted else list(self.model_memory)
        return [m for m in models if self.model_memory[m] >= request.gpu_memory_mb]

    def usable(self, gpu: GpuSlot, end_ms: float) -> bool:
        until = self.reserved.get(gpu.uuid)
        return until is None or end_ms <= until

    def find_dedicated(self, request: Request, end_ms: float) -> tuple[NodeSlot, list[GpuSlot]] | None:
        """Best fit: the node with the fewest idle GPUs (of one model) that still holds the gang.

        When nodes track host CPU and memory, a node that would be left with idle
        GPUs but too little CPU or memory to use them ("stranded") comes last.
        """
        best: tuple[tuple, NodeSlot, list[GpuSlot]] | None = None
        need = request.count
        for model in self.models_for(request):
            buckets = self.idle_dedicated.buckets.get(model)
            if not buckets:
                continue
            per_node = self.idle_dedicated.gpus[model]
            for count in range(need, len(buckets)):
                if best is not None and (0, count) >= best[0]:
                    break
                looked = 0
                for node in buckets[count].values():
                    if not node.host_fits(request.cpu_milli, request.memory_mib):
                        continue
                    gpus = [
                        g
                        for g in per_node[node.name].values()
                        if g.memory_mb >= request.gpu_memory_mb and self.usable(g, end_ms)
                    ]
                    if len(gpus) < need:
                        continue
                    key = (_strands(node, count - need, request), count)
                    if best is None or key < best[0]:
                        best = (key, node, gpus)
                    looked += 1
                    if key[0] == 0 or looked >= HOST_CANDIDATES:
                        break
            if best is not None and best[0] == (0, need):
                break
        if best is None:
            return None
        node, gpus = best[1], best[2]
        gpus.sort(key=lambda g: g.reservation != DEDICATED_ONLY)  # keep any-use GPUs for slices
        return node, gpus[:need]

    def find_shared(self, request: Request, end_ms: float) -> GpuSlot | None:
        """Best fit onto a GPU already shared; else open an idle GPU on the busiest node."""
        return self._find_room(request, end_ms) or self._find_idle_for_slice(request, end_ms)

    def _slice_fits(self, gpu: GpuSlot, request: Request, end_ms: float) -> bool:
        if gpu.memory_mb - gpu.used_memory_mb < slice_memory(gpu, request):
            return False
        if not self.nodes[gpu.node].host_fits(request.cpu_milli, request.memory_mib):
            return False
        return self.usable(gpu, end_ms)

    def _find_room(self, request: Request, end_ms: float) -> GpuSlot | None:
        best: tuple[int, GpuSlot] | None = None
        for model in self.models_for(request):
            keys = self.room_keys.get(model)
            if not keys:
                continue
            buckets = self.room[model]
            for i in range(bisect_left(keys, request.share_milli), len(keys)):
                free = keys[i]
                if best is not None and free >= best[0]:
                    break
                hit = next((g for g in buckets[free].values() if self._slice_fits(g, request, end_ms)), None)
                if hit is not None:
                    best = (free, hit)
                    break
        return best[1] if best else None

    def _find_idle_for_slice(self, request: Request, end_ms: float) -> GpuSlot | None:
        best: tuple[tuple, GpuSlot] | None = None
        for model in self.models_for(request):
            buckets = self.idle_shared.buckets.get(model)
            if not buckets:
                continue
            per_node = self.idle_shared.gpus[model]
            for count in range(1, len(buckets)):
                if best is not None and (0, count) >= best[0]:
                    break
                looked = 0
                for node in buckets[count].values():
                    gpus = sorted(per_node[node.name].values(), key=lambda g: g.reservation != SHARED_ONLY)
                    hit = next((g for g in gpus if self._slice_fits(g, request, end_ms)), None)
                    if hit is None:
                        continue
                    key = (_strands(node, count - 1, request), count)
                    if best is None or key < best[0]:
                        best = (key, hit)
                    looked += 1
                    if key[0] == 0 or looked >= HOST_CANDIDATES:
                        break
        return best[1] if best else None


HOST_CANDIDATES = 8  # nodes of equal fit compared on host resources before settling


def _strands(node: NodeSlot, idle_left: int, request: Request) -> int:
    """1 if placing ``request`` leaves idle GPUs on ``node`` without the CPU or memory a GPU
    of this kind of job needs (only when the node tracks host resources)."""
    if not idle_left or not (node.cpu_milli or node.memory_mib):
        return 0
    per_gpu = max(1, request.count if not request.shared else 1)
    cpu_left = node.cpu_milli - node.used_cpu_milli - request.cpu_milli
    memory_left = node.memory_mib - node.used_memory_mib - request.memory_mib
    if node.cpu_milli and cpu_left < idle_left * request.cpu_milli / per_gpu:
        return 1
    return int(bool(node.memory_mib) and memory_left < idle_left * request.memory_mib / per_gpu)


def slice_memory(gpu: GpuSlot, request: Request) -> int:
    """GPU memory a slice reserves: what it asked for, else its share of the card."""
    return request.gpu_memory_mb or request.share_milli * gpu.memory_mb // WHOLE
