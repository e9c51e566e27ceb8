"""Indexes over the fleet's free capacity, and the choice of a place.

- idle GPUs, per model, grouped by node and bucketed by how many idle GPUs the
  node has; one index for dedicated use and one for opening a GPU to slices
  (reservations differ);
- GPUs already shared with room left, per model, bucketed by free thousandths;
- nodes with GPUs (CPU-only requests).

Every bucket lists its nodes in the fleet's order (the order of ``nodes`` given
to the core: registration order on the platform, file order in the replays),
so that the first that fits is found without sorting.

A GPU is in an index only while its node is schedulable and it is healthy.

**The choice.** Of the places a request fits, the one with the lowest score,
compared in order (see :mod:`.score` for the terms that read the workload):

1. *model tier*: for work that names no model, a model that a constrained
   job waiting in the queue (of its class or higher) names comes last, and
   before it one whose free capacity the recent constrained demand would take;
2. *price*: the cheaper model per GPU-hour first (``Policy.model_price``);
3. *scarce places lost*: whether the placement takes away a place that a
   scarce class of the workload's mix needs (the growth of fragmentation,
   FGD-style, against the classes that have fewer places left than requests
   expected: the largest gangs, typically), so the few nodes that can host
   them are broken last;
4. not leaving idle GPUs on the node without the CPU or memory to use them
   ("stranded", for jobs like this one; a slice also for the lightest
   whole-GPU work of the mix);
5. the fit: an exact one (the gang fills the node's idle GPUs; the slice
   fills the GPU's room), then a partly used node, and only then a node
   with every GPU idle (kept whole for gangs); a slice that would leave the
   room on its GPU without the CPU the mix's slices need to fill it
   (``Mix.slice_cpu``) ranks half a step later: after a partly used node
   that keeps it usable, still before a whole node (or, on a whole node,
   after one that keeps it);
6. the fleet's order (first fit): load goes to the front of the fleet, the
   rest stays whole for what comes next;
7. on one node, the smaller card (for slices and for work that names no
   model when no price tells them apart).

The terms read indexes and memoised fragmentation, so a decision costs about
the same on 100 nodes as on 5,000. The scans skip, without a look, a bucket or
CPU band whose best possible score (its fit, the strands its CPU band forces,
its first place in the fleet's order) cannot beat the best found: only what
could not be chosen is skipped (``tests/scheduler/test_placement_same_decisions.py``).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import merge
from typing import Any

from .data import ANY, DEDICATED_ONLY, SHARED_ONLY, WHOLE, GpuSlot, NodeSlot, Request, mig_need, mig_take
from .score import Frag, Mix

HOST_ONLY = ("host",)
NO_ORDER = float("inf")  # the place in the fleet's order of an empty bucket's first item
CANDIDATES_PER_BUCKET = 3  # fitting nodes of one bucket looked at for one with no scarce place lost
MISSES_PER_BUCKET = 32  # nodes of a bucket too short of CPU/memory looked at before moving on (once a place is found)
ROOM_KEYS = 48  # room buckets (smallest room that fits first) looked at for a slice
HOST_CANDIDATES = 16  # nodes looked at for a CPU-only request once a place is found


def cpu_band(node: NodeSlot) -> int:
    """Nodes are banded by free host CPU (powers of two of thousandths of a core): a request skips the
    bands too small for it without looking at their nodes. Untracked CPU: the top band."""
    if not node.cpu_milli:
        return 64
    return max(0, node.cpu_milli - node.used_cpu_milli).bit_length()


class _Ordered:
    """Items in the fleet's order, banded by their node's free CPU."""

    __slots__ = ("bands", "first", "items", "size")

    def __init__(self):
        self.bands: dict[int, list[tuple[int, str]]] = {}
        self.items: dict[str, tuple[int, tuple[int, str], Any]] = {}
        self.size = 0
        # the lowest place in the fleet's order of any item (a bucket nothing beats is skipped); a float:
        # NO_ORDER is infinite
        self.first: float = NO_ORDER

    def add(self, key: str, item: Any, order: int, band: int) -> None:
        entry = (order, key)
        insort(self.bands.setdefault(band, []), entry)
        self.items[key] = (band, entry, item)
        self.size += 1
        if order < self.first:
            self.first = float(order)

    def remove(self, key: str) -> int:
        """Drop ``key``; its band."""
        band, entry, _ = self.items.pop(key)
        entries = self.bands[band]
        del entries[bisect_left(entries, entry)]
        if not entries:
            del self.bands[band]
        self.size -= 1
        if entry[0] == self.first:
            first = NO_ORDER
            for entries in self.bands.values():
                if entries[0][0] < first:
                    first = float(entries[0][0])
            self.first = first
        return band

    def rekey(self, key: str, band: int) -> None:
        old, entry, item = self.items[key]
        if old != band:
            self.remove(key)
            self.add(key, item, entry[0], band)

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return self.size

    def bands_for(self, cpu_milli: int) -> list[list[tuple[int, str]]]:
        """The bands whose nodes may have ``cpu_milli`` free (the ones below cannot), each in the fleet's
        order: the first fit is the first fit of one of them."""
        low = cpu_milli.bit_length() if cpu_milli > 0 else 0
        return [entries for band, entries in self.bands.items() if band >= low]

    def __iter__(self):
        items = self.items
        for _, key in merge(*self.bands.values()):
            yield items[key][2]


class _IdleIndex:
    """model -> node -> idle GPUs; model -> [count] -> nodes with that many, in the fleet's order;
    model -> the counts whose bucket is not empty, ascending (the scans skip the empty ones)."""

    def __init__(self, width: int, order: dict[str, int]):
        self.width = width
        self.order = order
        self.gpus: dict[str, dict[str, dict[str, GpuSlot]]] = {}
        self.buckets: dict[str, list[_Ordered]] = {}
        self.counts: dict[str, list[int]] = {}

    def _put(self, model: str, buckets: list[_Ordered], count: int, node: NodeSlot, band: int) -> None:
        bucket = buckets[count]
        bucket.add(node.name, node, self.order[node.name], band)
        if bucket.size == 1:
            insort(self.counts[model], count)

    def _take(self, model: str, buckets: list[_Ordered], count: int, node: NodeSlot) -> int:
        bucket = buckets[count]
        band = bucket.remove(node.name)
        if not bucket.size:
            counts = self.counts[model]
            del counts[bisect_left(counts, count)]
        return band

    def add(self, gpu: GpuSlot, node: NodeSlot) -> None:
        per_node = self.gpus.setdefault(gpu.model, {}).setdefault(node.name, {})
        buckets = self.buckets.get(gpu.model)
        if buckets is None:
            buckets = self.buckets[gpu.model] = [_Ordered() for _ in range(self.width + 1)]
            self.counts[gpu.model] = []
        count = len(per_node)
        band = self._take(gpu.model, buckets, count, node) if count else cpu_band(node)
        per_node[gpu.uuid] = gpu
        self._put(gpu.model, buckets, count + 1, node, band)

    def remove(self, gpu: GpuSlot, node: NodeSlot) -> None:
        per_node = self.gpus.get(gpu.model, {}).get(node.name)
        if not per_node or gpu.uuid not in per_node:
            return
        buckets = self.buckets[gpu.model]
        count = len(per_node)
        band = self._take(gpu.model, buckets, count, node)  # the node's host use has not changed: its band holds
        del per_node[gpu.uuid]
        if count > 1:
            self._put(gpu.model, buckets, count - 1, node, band)

    def rekey(self, node: NodeSlot, models: list[str]) -> None:
        """``node``'s free CPU changed: move it to its band in its buckets."""
        band = cpu_band(node)
        for model in models:
            per_node = self.gpus.get(model, {}).get(node.name)
            if per_node:
                self.buckets[model][len(per_node)].rekey(node.name, band)


class Fleet:
    def __init__(self, nodes: list[NodeSlot], *, price: dict[str, float] | None = None):
        self.nodes = {n.name: n for n in nodes}
        self.order = {n.name: i for i, n in enumerate(nodes)}
        self.cpu_nodes = [n for n in nodes if not n.gpus]
        self.hosts = _Ordered()  # schedulable nodes with GPUs, for CPU-only requests
        self._host_list = [n for n in nodes if n.gpus and n.schedulable]
        for n in self._host_list:
            self.hosts.add(n.name, n, self.order[n.name], cpu_band(n))
        # The score (see .score): the workload's mix, fragmentation against its scarce classes, prices per
        # GPU of a model, models kept for constrained work (``avoid``: named by constrained jobs in the
        # queue; ``needed``: by the recent mix).
        self.mix = Mix()
        self.frag = Frag(self.mix)
        self.price: dict[str, float] = dict(price or {})
        self.avoid: frozenset[str] = frozenset()
        self.needed: frozenset[str] = frozenset()
        self._frees: dict[tuple[str, str], tuple[int, ...]] = {}
        self._models_for: dict[tuple[str, int], list[str]] = {}
        self._choices_of: dict[tuple, list[tuple[str, tuple[int, float]]]] = {}
        self._models_of: dict[str, list[str]] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self.gpus: dict[str, GpuSlot] = {}
        self.model_memory: dict[str, int] = {}  # model -> largest memory of a GPU of it
        width = max((len(n.gpus) for n in nodes), default=0)
        self.idle_dedicated = _IdleIndex(width, self.order)
        # With no GPU reserved for one use, both indexes would hold the same: one is kept
        self.idle_shared = self.idle_dedicated
        if any(g.reservation != ANY for n in nodes for g in n.gpus):
            self.idle_shared = _IdleIndex(width, self.order)
        self.room: dict[str, dict[int, _Ordered]] = {}
        self.room_keys: dict[str, list[int]] = {}
        # Backfill and preemption reservations: GPU uuid -> the time from which
        # it is promised to a job; only requests ending by then may use it.
        self.reserved: dict[str, float] = {}
        # model -> most GPUs of it on one node: a node with that many idle has every GPU of the model idle
        self.model_most: dict[str, int] = {}
        for node in nodes:
            for gpu in node.gpus:
                self.gpus[gpu.uuid] = gpu
                if not (node.schedulable and gpu.healthy):
                    continue
                self.model_memory[gpu.model] = max(self.model_memory.get(gpu.model, 0), gpu.memory_mb)
                self.model_most[gpu.model] = max(self.model_most.get(gpu.model, 0), self._gpu_count(node, gpu.model))
                if gpu.idle:
                    self._idle_add(gpu, node)
                elif gpu.shared:
                    self._room_put(gpu)
        # Free GPU thousandths per model and in all, and idle GPUs per model and node, kept as placements
        # take them (the mix's refresh reads them; see refresh_mix)
        self.model_free: dict[str, int] = {}
        self.free_total = 0
        self.idle_of: dict[str, dict[str, int]] = {}
        for node in self._host_list:
            for gpu in node.gpus:
                if gpu.healthy:
                    self.model_free[gpu.model] = self.model_free.get(gpu.model, 0) + gpu.free_milli
                    self.free_total += gpu.free_milli
                    if gpu.free_milli == WHOLE:
                        idle = self.idle_of.setdefault(gpu.model, {})
                        idle[node.name] = idle.get(node.name, 0) + 1

    # -- index upkeep ----------------------------------------------------------
    def _idle_add(self, gpu: GpuSlot, node: NodeSlot) -> None:
        if gpu.reservation != SHARED_ONLY:
            self.idle_dedicated.add(gpu, node)
        if gpu.reservation != DEDICATED_ONLY and self.idle_shared is not self.idle_dedicated:
            self.idle_shared.add(gpu, node)

    def _idle_remove(self, gpu: GpuSlot, node: NodeSlot) -> None:
        self.idle_dedicated.remove(gpu, node)
        if self.idle_shared is not self.idle_dedicated:
            self.idle_shared.remove(gpu, node)

    def _gpu_order(self, gpu: GpuSlot) -> int:
        return self.order[gpu.node]

    def _room_put(self, gpu: GpuSlot) -> None:
        free = gpu.free_milli
        if free <= 0 or gpu.reservation == DEDICATED_ONLY:
            return
        buckets = self.room.setdefault(gpu.model, {})
        bucket = buckets.get(free)
        if bucket is None:
            bucket = buckets[free] = _Ordered()
            insort(self.room_keys.setdefault(gpu.model, []), free)
        bucket.add(gpu.uuid, gpu, self.order[gpu.node], cpu_band(self.nodes[gpu.node]))

    def _room_drop(self, gpu: GpuSlot) -> None:
        buckets = self.room.get(gpu.model)
        if buckets is None:
            return
        bucket = buckets.get(gpu.free_milli)
        if not bucket or gpu.uuid not in bucket:
            return
        bucket.remove(gpu.uuid)
        if not bucket:
            del buckets[gpu.free_milli]
            keys = self.room_keys[gpu.model]
            del keys[bisect_left(keys, gpu.free_milli)]

    # -- changes ---------------------------------------------------------------
    def use_host(self, node: NodeSlot, cpu_milli: int, memory_mib: int) -> None:
        """Host CPU and memory taken on ``node``; its entries move to their new CPU band."""
        before = cpu_band(node) if cpu_milli and node.cpu_milli else None
        node.used_cpu_milli += cpu_milli
        node.used_memory_mib += memory_mib
        if before is None:
            return
        band = cpu_band(node)
        if band == before:
            return  # still in its band: nothing moves
        if node.name in self.hosts:
            self.hosts.rekey(node.name, band)
        models = self._node_models(node)
        self.idle_dedicated.rekey(node, models)
        if self.idle_shared is not self.idle_dedicated:
            self.idle_shared.rekey(node, models)
        for gpu in node.gpus:
            bucket = self.room.get(gpu.model, {}).get(gpu.free_milli)
            if bucket is not None and gpu.uuid in bucket:
                bucket.rekey(gpu.uuid, band)

    def take_host(self, node: NodeSlot, request: Request) -> None:
        self.use_host(node, request.cpu_milli, request.memory_mib)

    def _freed(self, node: NodeSlot, gpu: GpuSlot, before: int) -> None:
        """``gpu``'s free thousandths went from ``before`` to what they are now: the totals follow."""
        change = gpu.free_milli - before
        self.model_free[gpu.model] += change
        self.free_total += change
        if before == WHOLE:
            idle = self.idle_of[gpu.model]
            idle[node.name] -= 1
            if not idle[node.name]:
                del idle[node.name]

    def take_whole(self, node: NodeSlot, gpus: list[GpuSlot], request: Request) -> None:
        for gpu in gpus:
            self._idle_remove(gpu, node)
            before = gpu.free_milli
            gpu.dedicated = True
            gpu.used_milli = WHOLE
            self._freed(node, gpu, before)
            self._frees.pop((node.name, gpu.model), None)
        self.use_host(node, request.cpu_milli, request.memory_mib)

    def take_share(self, gpu: GpuSlot, request: Request) -> None:
        node = self.nodes[gpu.node]
        if gpu.idle:
            self._idle_remove(gpu, node)
        else:
            self._room_drop(gpu)
        before = gpu.free_milli
        gpu.used_milli += request.share_milli
        self._freed(node, gpu, before)
        gpu.used_memory_mb += slice_memory(gpu, request)
        if gpu.mig is not None:
            mig_take(gpu, request.share_milli)
        self._frees.pop((node.name, gpu.model), None)
        self.use_host(node, request.cpu_milli, request.memory_mib)
        self._room_put(gpu)

    # -- questions -------------------------------------------------------------
    def models_for(self, request: Request) -> list[str]:
        key = (request.gpu_model, request.gpu_memory_mb)
        found = self._models_for.get(key)
        if found is None:
            wanted = request.models
            models = [m for m in wanted if m in self.model_memory] if wanted else list(self.model_memory)
            found = self._models_for[key] = [m for m in models if self.model_memory[m] >= request.gpu_memory_mb]
        return found

    def _choices(self, request: Request) -> list[tuple[str, tuple[int, float]]]:
        """The models ``request`` may use, each with its tier and price (see :meth:`_model_key`)."""
        key = (request.gpu_model, request.gpu_memory_mb, self.avoid, self.needed)
        found = self._choices_of.get(key)
        if found is None:
            found = self._choices_of[key] = [(m, self._model_key(m, request)) for m in self.models_for(request)]
        return found

    def usable(self, gpu: GpuSlot, end_ms: float) -> bool:
        if not self.reserved:
            return True
        until = self.reserved.get(gpu.uuid)
        return until is None or end_ms <= until

    # -- the workload (see .score) ----------------------------------------------
    def observe(self, request: Request) -> None:
        """Count ``request`` in the workload's mix (online use: every request offered)."""
        self.mix.add(request)
        if self.mix.due():
            self.refresh_mix()

    def refresh_mix(self) -> None:
        """Recompute the mix's classes against the fleet as it is now (how many places each gang class
        has, which models constrained work needs)."""
        mix = self.mix
        mix.refresh()  # the classes first, then their places
        gangs = {i: c for i, c in enumerate(mix.classes) if c[1] >= 2}
        places = [0] * len(mix.classes)
        if gangs:
            fewest = min(c[1] for c in gangs.values())
            for model, idle_nodes in self.idle_of.items():
                for name, idle in idle_nodes.items():
                    if idle < fewest:
                        continue
                    node = self.nodes[name]
                    for key, (_, count, _, cpu, memory, models) in gangs.items():
                        if idle >= count and (not models or model in models) and node.host_fits(cpu, memory):
                            places[key] += idle // count
        mix.refresh(places, self.free_total)
        self.needed = mix.needed(self.model_free, self.free_total)

    def _node_models(self, node: NodeSlot) -> list[str]:
        models = self._models_of.get(node.name)
        if models is None:
            models = self._models_of[node.name] = sorted({g.model for g in node.gpus if g.healthy})
        return models

    def _gpu_count(self, node: NodeSlot, model: str) -> int:
        key = (node.name, model)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = sum(1 for g in node.gpus if g.model == model and g.healthy)
        return count

    def frees(self, node: NodeSlot, model: str) -> tuple[int, ...]:
        """Free thousandths of each usable GPU of ``model`` on ``node``, sorted (0: held whole or full)."""
        key = (node.name, model)
        frees = self._frees.get(key)
        if frees is None:
            frees = self._frees[key] = tuple(sorted(g.free_milli for g in node.gpus if g.model == model and g.healthy))
        return frees

    def scarce_lost(self, node: NodeSlot, model: str, request: Request, op: tuple) -> int:
        """1 if ``request`` taking ``op`` on ``node`` grows its fragmentation against the scarce classes
        of the mix (it takes away a place they need), else 0 (see :meth:`.score.Frag.delta`)."""
        mix = self.mix
        if not mix.scarce:
            return 0
        frees = self.frees(node, model)
        smallest = mix.scarce_smallest.get(model, mix.scarce_smallest.get("", 0))
        if not smallest or frees.count(WHOLE) < smallest:
            return 0  # no scarce gang fits here now: nothing to lose
        grow = self.frag.delta(
            model,
            node.cpu_milli - node.used_cpu_milli if node.cpu_milli else None,
            node.memory_mib - node.used_memory_mib if node.memory_mib else None,
            frees,
            request.cpu_milli,
            request.memory_mib,
            op,
        )
        return 1 if grow > 0 else 0

    def _model_key(self, model: str, request: Request) -> tuple[int, float]:
        """Tier (for work that could run anywhere: 2 on a model a waiting constrained job needs, 1 on one the
        recent constrained demand needs, else 0) and price."""
        tier = 0
        if not request.models:
            tier = 2 if model in self.avoid else 1 if model in self.needed else 0
        return tier, self.price.get(model, 0.0)

    # -- the choice ------------------------------------------------------------------
    def find_dedicated(self, request: Request, end_ms: float) -> tuple[NodeSlot, list[GpuSlot]] | None:
        """The gang's node: of the nodes with enough idle GPUs of one model that fit it, the lowest score
        (see the module's docstring). Per model and bucket of idle count, the first nodes in the
        fleet's order are compared."""
        need = request.count
        if need == 0:
            return self.find_host(request)
        # the best key, its node and GPUs (a list, or the node's idle GPUs of the model by uuid)
        best: tuple[tuple, NodeSlot, Any] | None = None
        best5: tuple = ()  # the best key's first five and six terms (compared with the bounds once there is one)
        best6: tuple = ()
        reserved = bool(self.reserved)
        cpu, memory = request.cpu_milli, request.memory_mib
        low = cpu.bit_length() if cpu > 0 else 0
        per_gpu = max(1, need)
        scarce = bool(self.mix.scarce)
        for model, model_key in self._choices(request):
            buckets = self.idle_dedicated.buckets.get(model)
            if not buckets:
                continue
            if best is not None and model_key > best[0][:2]:
                continue
            per_node = self.idle_dedicated.gpus[model]
            op = ("whole", need)
            most = self.model_most[model]
            model_memory = self.model_memory[model]
            counts = self.idle_dedicated.counts[model]
            for count in counts[bisect_left(counts, need) :]:
                bucket = buckets[count]
                # the best any node of this bucket can score (a bucket of the model's largest nodes holds
                # only nodes with every GPU idle: fit 2)
                fit_least = 0 if count == need else 2 if count == most else 1
                if best is not None and (*model_key, 0, 0, fit_least, bucket.first) > best6:
                    continue  # nothing in this bucket can beat what we have
                items = bucket.items
                idle_left = count - need
                # the CPU and memory the idle GPUs left would need (see _strands, inline below)
                stranding = idle_left * cpu / per_gpu
                stranding_memory = idle_left * memory / per_gpu
                for band, entries in bucket.bands.items():
                    if band < low:
                        continue  # too little CPU free on every node of the band
                    # every node of the band strands idle GPUs when even its most free CPU is short
                    short = int(bool(idle_left) and band < 64 and (1 << band) - 1 - cpu < stranding)
                    prefix = (*model_key, 0, short, fit_least)
                    if best is not None and prefix > best5:
                        continue  # nothing in this band can beat what we have
                    looked = missed = 0
                    # beyond this place in the fleet's order nothing of the band beats the best
                    limit = best6[5] if best is not None and prefix == best5 else None
                    for order, name in entries:
                        if limit is not None and order > limit:
                            break
                        node: NodeSlot = items[name][2]
                        if (cpu and node.cpu_milli and node.used_cpu_milli + cpu > node.cpu_milli) or (
                            memory and node.memory_mib and node.used_memory_mib + memory > node.memory_mib
                        ):  # not node.host_fits(cpu, memory), inline: the hottest test of the scan
                            missed += 1
                            if missed >= MISSES_PER_BUCKET and best is not None:
                                break
                            continue
                        if reserved or request.gpu_memory_mb:
                            gpus = [
                                g
                                for g in per_node[name].values()
                                if g.memory_mb >= request.gpu_memory_mb and self.usable(g, end_ms)
                            ]
                            if len(gpus) < need:
                                continue
                        else:
                            gpus = None  # all of the node's idle GPUs of the model (listed if it is the best)
                        lost = self.scarce_lost(node, model, request, op) if scarce else 0
                        strands = 0  # _strands(node, idle_left, request), inline
                        if idle_left:
                            if node.cpu_milli and node.cpu_milli - node.used_cpu_milli - cpu < stranding:
                                strands = 1
                            elif node.memory_mib and node.memory_mib - node.used_memory_mib - memory < stranding_memory:
                                strands = 1
                        fit = fit_least if fit_least != 1 else 2 if count == self._gpu_count(node, model) else 1
                        key = (*model_key, lost, strands, fit, order, model_memory)
                        if best is None or key < best[0]:
                            best = (key, node, gpus if gpus is not None else per_node[name])
                            best5, best6 = key[:5], key[:6]
                            limit = order if prefix == best5 else None
                        looked += 1
                        if not (lost or strands) or looked >= CANDIDATES_PER_BUCKET:
                            break
        if best is None:
            return None
        chosen = best[2]
        found: list[GpuSlot] = chosen if isinstance(chosen, list) else list(chosen.values())  # all idle of the model
        found.sort(key=lambda g: g.reservation != DEDICATED_ONLY)  # keep any-use GPUs for slices
        return best[1], found[:need]

    def find_host(self, request: Request) -> tuple[NodeSlot, list[GpuSlot]] | None:
        """A CPU-only request: the first node without GPUs that fits; else, of the nodes with GPUs in the
        fleet's order, the first that takes no place a scarce class needs."""
        for node in self.cpu_nodes:
            if node.schedulable and node.host_fits(request.cpu_milli, request.memory_mib):
                return node, []
        best: tuple[tuple[int, int], NodeSlot] | None = None
        items = self.hosts.items
        for entries in self.hosts.bands_for(request.cpu_milli):
            looked = 0
            for order, name in entries:
                if best is not None and (0, order) >= best[0]:
                    break
                node = items[name][2]
                if not node.host_fits(request.cpu_milli, request.memory_mib):
                    continue
                lost = max((self.scarce_lost(node, m, request, HOST_ONLY) for m in self._node_models(node)), default=0)
                if best is None or (lost, order) < best[0]:
                    best = ((lost, order), node)
                looked += 1
                if not lost or looked >= HOST_CANDIDATES:
                    break
        return (best[1], []) if best else None

    def find_shared(self, request: Request, end_ms: float) -> GpuSlot | None:
        """The slice's GPU: of the GPUs with room that fit it (shared GPUs, by room, the smallest rooms
        that fit first; then idle GPUs, by the node's idle count), the lowest score (see the module's
        docstring)."""
        best: list = [None, None]  # key, GPU
        for model, model_key in self._choices(request):
            if best[0] is not None and model_key > best[0][:2]:
                continue
            keys = self.room_keys.get(model)
            if keys:
                buckets = self.room[model]
                first = bisect_left(keys, request.share_milli)
                share = request.share_milli
                for free in keys[first : first + ROOM_KEYS]:
                    if best[0] is not None:
                        if free != share and (*model_key, 0, 0, 1) > best[0][:5]:
                            break  # partial fits from here on: none beats what we have
                        if (*model_key, 0, 0, free != share, buckets[free].first) >= best[0]:
                            continue  # every GPU of the bucket is later in the order than the best
                    self._slice_scan(buckets[free], model, model_key, request, end_ms, best, True, int(free != share))
            idle_buckets = self.idle_shared.buckets.get(model)
            if idle_buckets:
                most = self.model_most[model]
                for count in self.idle_shared.counts[model]:
                    bucket = idle_buckets[count]
                    fit_least = 2 if count == most else 1
                    if best[0] is not None and (*model_key, 0, 0, fit_least, bucket.first) >= best[0]:
                        continue  # no node of the bucket can beat the best
                    self._slice_scan(bucket, model, model_key, request, end_ms, best, False, fit_least)
        return best[1]

    def _slice_scan(
        self,
        bucket: _Ordered,
        model: str,
        model_key: tuple[int, float],
        request: Request,
        end_ms: float,
        best: list,
        shared: bool,
        fit_least: int,
    ) -> None:
        """The first GPUs of ``bucket`` (shared GPUs, or nodes with idle GPUs) that fit, in the fleet's
        order, scored into ``best`` (stops at the first that loses no scarce place). ``fit_least``: the
        lowest fit a GPU of the bucket can score (a room bucket: 0 when its room is the slice's, else 1)."""
        per_node: dict[str, dict[str, GpuSlot]] = {} if shared else self.idle_shared.gpus[model]
        items = bucket.items
        cpu = request.cpu_milli
        low = cpu.bit_length() if cpu > 0 else 0
        share = request.share_milli
        scarce = bool(self.mix.scarce)
        least_cpu, slice_cpu = self.mix.least_cpu, self.mix.slice_cpu
        for band, entries in bucket.bands.items():
            if band < low:
                continue  # too little CPU free on every node of the band
            # the least strands any node of the band can score (idle GPUs left behind without the CPU)
            strands_least = 0
            if not shared:
                strands_least = _strands_least(band, len(per_node[entries[0][1]]) - 1, cpu, 1)
                if best[0] is not None and (*model_key, 0, strands_least, fit_least) > best[0][:5]:
                    continue  # nothing in this band can beat what we have
            looked = missed = 0
            for order, name in entries:
                item = items[name][2]
                gpu: GpuSlot | None
                exact = fit_least  # a room bucket: whether its room is more than the slice (the same for all)
                if best[0] is not None and (*model_key, 0, strands_least, exact, order) >= best[0]:
                    break  # later in the order: no better than what we have
                if shared:
                    gpu = item if self._slice_fits(item, request, end_ms) else None
                elif not item.host_fits(request.cpu_milli, request.memory_mib):
                    gpu = None  # no GPU of the node fits (see _slice_fits)
                else:  # a GPU kept for slices first
                    gpus = per_node[name].values()
                    gpu = None
                    for g in gpus:
                        if g.reservation == SHARED_ONLY and self._slice_fits(g, request, end_ms):
                            gpu = g
                            break
                    else:
                        for g in gpus:
                            if self._slice_fits(g, request, end_ms):
                                gpu = g
                                break
                if gpu is None:
                    missed += 1
                    if missed >= MISSES_PER_BUCKET and best[0] is not None:
                        break
                    continue
                node = self.nodes[gpu.node]
                lost = self.scarce_lost(node, model, request, ("share", gpu.free_milli, share)) if scarce else 0
                # idle GPUs the slice leaves on the node (a shared GPU's node: not judged, see below)
                idle_left = 0 if shared else len(per_node[name]) - 1
                strands = 0 if shared else _strands(node, idle_left, request, least_cpu)
                fit = exact
                if not shared and idle_left + 1 == self._gpu_count(node, model):
                    fit = 2  # the first slice on a node with every GPU idle: breaks a whole node
                # half a step later: a slice that leaves room on its GPU without the CPU the mix's slices need to
                # fill it (on top of what the idle GPUs left need; filling a shared GPU, only the room is judged)
                roomless = False  # CPU only: the room adds no memory need, and the idle GPUs' own is met (strands 0)
                if slice_cpu and not strands and node.cpu_milli and gpu.free_milli != share:
                    need = idle_left * (least_cpu if least_cpu > cpu else cpu) + (gpu.free_milli - share) * slice_cpu
                    if node.cpu_milli - node.used_cpu_milli - cpu < need:
                        roomless = True
                key = (*model_key, lost, strands, fit + 0.5 if roomless else fit, order, self.model_memory[model])
                if best[0] is None or key < best[0]:
                    best[0], best[1] = key, gpu
                looked += 1
                if not (lost or strands or roomless) or looked >= CANDIDATES_PER_BUCKET:
                    break

    def _slice_fits(self, gpu: GpuSlot, request: Request, end_ms: float) -> bool:
        # slice_memory(), NodeSlot.host_fits() and usable(), inline: the scans call this for every GPU
        if gpu.memory_mb - gpu.used_memory_mb < (request.gpu_memory_mb or request.share_milli * gpu.memory_mb // WHOLE):
            return False
        if gpu.mig is not None and (not gpu.mig_free or gpu.mig_free[-1][0] < mig_need(gpu, request.share_milli)):
            return False  # MIG: only a free instance that holds the slice
        node = self.nodes[gpu.node]
        cpu, memory = request.cpu_milli, request.memory_mib
        if (cpu and node.cpu_milli and node.used_cpu_milli + cpu > node.cpu_milli) or (
            memory and node.memory_mib and node.used_memory_mib + memory > node.memory_mib
        ):
            return False
        return not self.reserved or self.usable(gpu, end_ms)


def _strands(node: NodeSlot, idle_left: int, request: Request, least_cpu: float = 0.0) -> int:
    """1 if placing ``request`` leaves idle GPUs on ``node`` without the CPU or memory a GPU of this kind
    of job needs (only when the node tracks host resources). ``least_cpu``: the CPU per GPU that any whole
    GPU of the workload needs at the least (a slice that leaves idle GPUs less strands them for whole-GPU
    work, though other slices might still use them)."""
    if not idle_left or not (node.cpu_milli or node.memory_mib):
        return 0
    per_gpu = max(1, request.count if not request.shared else 1)
    cpu_left = node.cpu_milli - node.used_cpu_milli - request.cpu_milli
    memory_left = node.memory_mib - node.used_memory_mib - request.memory_mib
    if node.cpu_milli and cpu_left < idle_left * max(least_cpu, request.cpu_milli / per_gpu):
        return 1
    return int(bool(node.memory_mib) and memory_left < idle_left * request.memory_mib / per_gpu)


def _strands_least(band: int, idle_left: int, cpu_milli: int, per_gpu: int) -> int:
    """1 if every node of CPU ``band`` (see :func:`cpu_band`) strands (see :func:`_strands`) idle GPUs when a
    request of ``cpu_milli`` leaves ``idle_left`` of them: even the most free CPU the band holds is short."""
    if not idle_left or band >= 64:
        return 0
    return int((1 << band) - 1 - cpu_milli < idle_left * cpu_milli / per_gpu)


def slice_memory(gpu: GpuSlot, request: Request) -> int:
    """GPU memory a slice reserves: what it asked for, else its share of the card."""
    return request.gpu_memory_mb or request.share_milli * gpu.memory_mb // WHOLE
