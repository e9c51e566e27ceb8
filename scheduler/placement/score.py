"""What a placement costs the work still to come: the fragmentation score and model scarcity.

The FGD idea (Weng et al., USENIX ATC 2023): a node's *fragmentation*,
against a workload, is the GPU capacity (thousandths) free on it that a task
of the workload could not use there, averaged over the workload's mix of
task shapes. For one task class: all of the node's free GPU when the task
cannot run there at all (another model, too little host CPU or memory, not
enough whole idle GPUs for its gang, no GPU with room for its slice); else
the free part of the GPUs too small for its per-GPU demand. Of the places a
request fits, the one whose fragmentation grows least (``delta``) keeps the
most capacity usable for what arrives next.

:class:`Mix` is the workload's shape: classes of request (GPUs, per-GPU share
in tenths, allowed models, and for gangs the CPU they ask for, in powers of
two) with their weight and the median CPU, memory and share of their recent
members, learned from the requests seen (``Policy.recent`` and the queue, or
every request offered to a :class:`~.core.Session`). From it:

- *scarce classes*: gang classes with fewer places left in the fleet than
  requests of them expected before it fills (the largest gangs: an 8-GPU job
  with 88 cores fits only on a node with 8 idle GPUs and the CPU to match).
  :meth:`Frag.delta` measures fragmentation against these only; the fleet
  breaks one of their few places last (``Fleet.scarce_lost``);
- *model scarcity*: the share of recent GPU demand that may only run on given
  models tells, per model, how much of its free capacity constrained work is
  expected to need; a model whose free capacity that demand would take
  (``needed``) is kept for it: work that could run anywhere goes elsewhere
  first (after the models constrained jobs waiting in the queue name).

Everything here is plain arithmetic over plain data: deterministic, no I/O.
"""

from __future__ import annotations

from bisect import bisect_right, insort

from .data import WHOLE, Request

MAX_CLASSES = 12  # the heaviest classes kept (the rest, rare shapes, are dropped; gang classes are all kept)
REFRESH_EVERY = 512  # requests seen between two recomputations of the classes
HALF_LIFE = 4096  # requests: older ones count half
SCARCE_AT = 0.75  # a gang class is scarce once its expected requests reach 3/4 of its places (others take some)
SCARCE_CAP = 8.0  # a class's weight is raised at most this much for being scarce
NEEDED_FRACTION = 0.5  # a model is kept for constrained work when it would need this much of its free capacity


SAMPLES = 64  # recent members per class whose median CPU, memory and share stand for the class


def class_key(request: Request) -> tuple[int, int, tuple[str, ...], int]:
    """(GPUs, per-GPU share rounded up to a tenth, allowed models, host CPU band); CPU-only work is
    (0, 0, (), 0). Gangs are told apart by the CPU they ask for (:func:`cpu_class`): the largest need the
    few nodes with the most CPU."""
    if request.shared:
        return (1, -(-request.share_milli // 100) * 100, request.models, 0)
    if request.count >= 2:
        return (request.count, WHOLE, request.models, cpu_class(request.cpu_milli))
    return (request.count, WHOLE if request.count else 0, request.models, 0)


def cpu_class(cpu_milli: int) -> int:
    """Host CPU in quarter-octaves: 88 and 120 cores fall apart (a 96-core node hosts one, not the other)."""
    bits = cpu_milli.bit_length()
    return bits * 4 + (cpu_milli >> (bits - 3) & 3 if bits >= 3 else 0)


class Mix:
    """The recent mix of request shapes, decayed, and what the fleet's state makes of it."""

    def __init__(self) -> None:
        self.seen = 0
        self.weights: dict[tuple, float] = {}  # class key -> decayed count
        self.samples: dict[tuple, list[tuple[int, int, int]]] = {}  # class key -> recent (cpu, memory, share)
        self.scale = 1.0  # decay by growing the weight of new requests (renormalised now and then)
        # Derived (by refresh): (weight, count, milli, cpu, memory, models) per class, heaviest first.
        self.classes: list[tuple[float, int, int, int, int, frozenset[str]]] = []
        self.cpu_levels: list[int] = []
        self.memory_levels: list[int] = []
        self.scarce: list[tuple[float, int, int, int, int, frozenset[str]]] = []
        self.scarce_smallest: dict[str, int] = {}
        self.constrained: dict[str, float] = {}  # model -> share of GPU demand that may only run on a set with it
        self.version = 0
        self.least_cpu = 0.0  # see refresh
        self.slice_cpu = 0.0  # see refresh
        self._next_refresh = 1

    def add(self, request: Request, weight: float = 1.0) -> None:
        key = class_key(request)
        w = weight * self.scale
        self.weights[key] = self.weights.get(key, 0.0) + w
        samples = self.samples.setdefault(key, [])
        if len(samples) >= SAMPLES:
            samples[self.seen % SAMPLES] = (request.cpu_milli, request.memory_mib, request.share_milli)
        else:
            samples.append((request.cpu_milli, request.memory_mib, request.share_milli))
        self.seen += 1
        self.scale *= 2 ** (1 / HALF_LIFE)
        if self.scale > 1e6:
            for k in self.weights:
                self.weights[k] /= self.scale
            self.scale = 1.0

    def due(self) -> bool:
        return self.seen >= self._next_refresh

    def refresh(self, places: list[int] | None = None, free_milli: int = 0) -> None:
        """Recompute the classes. ``places``: how many of each class (as the previous refresh listed them)
        the fleet can host now (gangs only); ``free_milli``: the fleet's free GPU capacity."""
        self._next_refresh = self.seen + (self.seen if self.seen < REFRESH_EVERY else REFRESH_EVERY)
        self.version += 1
        total = sum(self.weights.values())
        if not total:
            self.classes, self.scarce, self.scarce_smallest = [], [], {}
            return
        ranked = sorted(self.weights.items(), key=lambda kv: (-kv[1], kv[0]))
        # the heaviest classes, and every gang class however rare: the rare large gangs are the ones whose
        # few places run out first
        heaviest = ranked[:MAX_CLASSES] + [kv for kv in ranked[MAX_CLASSES:] if kv[0][0] >= 2]
        demand = sum(w * k[0] * k[1] for k, w in self.weights.items()) / total  # mean thousandths per request
        classes = []
        scarcity = []
        for index, (key, w) in enumerate(heaviest):
            count, milli, models, _ = key
            samples = self.samples[key]
            mid = len(samples) // 2
            cpu = sorted(x[0] for x in samples)[mid]
            memory = sorted(x[1] for x in samples)[mid]
            if count == 1 and milli < WHOLE:
                milli = sorted(x[2] for x in samples)[mid]
            share = w / total
            boost = 1.0
            expected_ratio = 0.0
            if places is not None and count >= 2 and demand:
                expected = share * free_milli / demand  # requests of this class still to come, roughly
                expected_ratio = expected / max(1, places[index] if index < len(places) else 0)
                boost = min(SCARCE_CAP, max(1.0, expected_ratio))
            classes.append((share * boost, count, milli, cpu, memory, frozenset(models)))
            scarcity.append(places is not None and count >= 2 and demand and expected_ratio >= SCARCE_AT)
        self.classes = classes
        # the least CPU per GPU that whole-GPU work of the mix asks for (a slice that leaves an idle GPU less
        # strands it: see Fleet's slice scan)
        self.least_cpu = min((c[3] / c[1] for c in classes if c[1] >= 1 and c[2] == WHOLE and c[3]), default=0.0)
        # the least CPU per GPU thousandth that slices of the mix ask for: the room a slice leaves on its GPU
        # needs at least that much per thousandth to be filled (a half of 8 cores: 16 cores per GPU; see
        # Fleet's slice scan). A class asking no CPU makes it 0: any room can be filled.
        self.slice_cpu = min((c[3] / c[2] for c in classes if c[1] == 1 and 0 < c[2] < WHOLE), default=0.0)
        # The scarce classes: fewer places left than requests of them expected. The fragmentation the
        # core scores is against these.
        self.scarce = [c for c, scarce in zip(classes, scarcity, strict=True) if scarce]
        # model ("" for any) -> the fewest GPUs a scarce class of it needs: a node with fewer idle loses nothing
        smallest: dict[str, int] = {}
        for c in self.scarce:
            for model in c[5] or ("",):
                smallest[model] = min(smallest.get(model, c[1]), c[1])
        if "" in smallest:
            for model in list(smallest):
                smallest[model] = min(smallest[model], smallest[""])
        self.scarce_smallest = smallest
        self.cpu_levels = sorted({c[3] for c in self.scarce})
        self.memory_levels = sorted({c[4] for c in self.scarce})
        constrained: dict[str, float] = {}
        gpu_total = sum(w * k[0] * k[1] for k, w in self.weights.items()) or 1.0
        for (count, milli, models, _), w in self.weights.items():
            if models and count:
                for model in models:
                    constrained[model] = constrained.get(model, 0.0) + w * count * milli / len(models) / gpu_total
        self.constrained = constrained

    def needed(self, model_free: dict[str, int], free_milli: int) -> frozenset[str]:
        """Models whose free capacity the constrained work still to come would take a good part of."""
        return frozenset(
            m
            for m, share in self.constrained.items()
            if share * free_milli >= NEEDED_FRACTION * max(1, model_free.get(m, 0))
        )


class Frag:
    """A node's fragmentation against a :class:`Mix`, memoised on the node's state as the classes see it."""

    def __init__(self, mix: Mix):
        self.mix = mix
        self.cache: dict[tuple, float] = {}
        self.deltas: dict[tuple, float] = {}
        self.version = -1

    def delta(
        self,
        model: str,
        cpu_free: int | None,
        memory_free: int | None,
        frees: tuple[int, ...],
        cpu: int,
        memory: int,
        op: tuple,
    ) -> float:
        """Growth of the fragmentation of a node's ``model`` GPUs (free host ``cpu_free``/``memory_free``,
        ``None``: not tracked; free shares ``frees``, sorted) when a request of ``cpu``/``memory`` takes
        ``op``: ``("whole", n)`` n idle GPUs, ``("share", free, share)`` a slice of a GPU with ``free``
        room, ``("host",)`` host resources only."""
        mix = self.mix
        if self.version != mix.version:
            self.cache.clear()
            self.deltas.clear()
            self.version = mix.version
        levels_cpu, levels_memory = mix.cpu_levels, mix.memory_levels
        if cpu_free is None:
            before_cpu = after_cpu = len(levels_cpu)
        else:
            before_cpu = bisect_right(levels_cpu, cpu_free)
            after_cpu = bisect_right(levels_cpu, cpu_free - cpu)
        if memory_free is None:
            before_memory = after_memory = len(levels_memory)
        else:
            before_memory = bisect_right(levels_memory, memory_free)
            after_memory = bisect_right(levels_memory, memory_free - memory)
        key = (model, before_cpu, before_memory, after_cpu, after_memory, frees, op)
        hit = self.deltas.get(key)
        if hit is not None:
            return hit
        if op[0] == "whole":
            after = (0,) * op[1] + frees[: len(frees) - op[1]]
        elif op[0] == "share":
            rest = list(frees)
            rest.remove(op[1])
            insort(rest, op[1] - op[2])
            after = tuple(rest)
        else:
            after = frees
        value = self._of((model, after_cpu, after_memory, after)) - self._of((model, before_cpu, before_memory, frees))
        self.deltas[key] = value
        return value

    def _of(self, key: tuple) -> float:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        mix = self.mix
        model, cpu_level, memory_level, frees = key
        value = 0.0
        total = sum(frees)
        if total:
            idle = frees.count(WHOLE)
            largest = frees[-1]
            cpu_ok = mix.cpu_levels[:cpu_level]
            memory_ok = mix.memory_levels[:memory_level]
            cpu_max = cpu_ok[-1] if cpu_ok else -1
            memory_max = memory_ok[-1] if memory_ok else -1
            for weight, count, milli, cpu, memory, models in mix.scarce:
                if cpu > cpu_max and cpu > 0 or memory > memory_max and memory > 0 or (models and model not in models):
                    value += weight * total
                elif count == 0:
                    continue
                elif milli < WHOLE:
                    value += weight * (total if largest < milli else sum(f for f in frees if f < milli))
                else:
                    value += weight * (total if idle < count else total - WHOLE * idle)
        self.cache[key] = value
        return value
