"""Choosing preemption victims: the cheapest set that actually makes room.

A victim is a running job whose class the requester's class may preempt
(``Policy.may_preempt``), that is preemptible, of a lower rank, past its
minimum runtime, and not already stopping. The cost of a set is the work it
throws away (GPU thousandths x milliseconds run so far), lower ranks first.
If no set of eligible victims frees enough room where the requester could run,
nothing is preempted: the requester waits, and no loop of preemptions starts.
"""

from __future__ import annotations

from .data import DEDICATED_ONLY, SHARED_ONLY, WHOLE, GpuSlot, Policy, Request, Running
from .fleet import Fleet, slice_memory


def victims_eligible(request: Request, running: list[Running], policy: Policy, taken: set[int]) -> list[Running]:
    allowed = policy.may_preempt.get(request.priority)
    if not allowed:
        return []
    return [
        r
        for r in running
        if r.priority in allowed
        and r.preemptible
        and r.rank < request.rank
        and not r.stopping
        and r.job_id not in taken
        and policy.now_ms - r.started_ms >= r.min_runtime_ms
    ]


def _cost(victim: Running, now_ms: int) -> tuple[int, int]:
    return victim.rank, victim.milli * max(0, now_ms - victim.started_ms)


def victims_choose(
    fleet: Fleet, request: Request, candidates: list[Running], now_ms: int
) -> tuple[list[Running], list[GpuSlot]] | None:
    """The cheapest victims on one node (or one GPU) whose exit lets ``request`` run there."""
    by_node: dict[str, list[Running]] = {}
    for victim in candidates:
        by_node.setdefault(victim.node, []).append(victim)
    models = set(fleet.models_for(request))
    best: tuple[tuple, list[Running], list[GpuSlot]] | None = None
    for node_name, victims in by_node.items():
        node = fleet.nodes.get(node_name)
        if node is None or not node.schedulable:
            continue
        victims.sort(key=lambda v: _cost(v, now_ms))
        if request.shared:
            gpus = [
                g
                for g in node.gpus
                if g.model in models
                and g.healthy
                and g.reservation != DEDICATED_ONLY
                and g.uuid not in fleet.reserved
                and g.memory_mb >= slice_memory(g, request)
            ]
            for gpu in gpus:
                found = _make_room(victims, [gpu], lambda free, g=gpu: _slice_room(g, free, request))
                if found and (best is None or _set_cost(found, now_ms) < best[0]):
                    best = (_set_cost(found, now_ms), found, [gpu])
            continue
        for model in models:
            gpus = [
                g
                for g in node.gpus
                if g.model == model
                and g.healthy
                and g.reservation != SHARED_ONLY
                and g.uuid not in fleet.reserved
                and g.memory_mb >= request.gpu_memory_mb
            ]
            if len(gpus) < request.count:
                continue
            found = _make_room(victims, gpus, lambda free, gs=gpus: _whole_room(gs, free) >= request.count)
            if found and (best is None or _set_cost(found, now_ms) < best[0]):
                chosen = [g for g in gpus if g.idle or _freed(g, {v.job_id for v in found})][: request.count]
                best = (_set_cost(found, now_ms), found, chosen)
    if best is None:
        return None
    return best[1], best[2]


def _set_cost(victims: list[Running], now_ms: int) -> tuple:
    return (max(v.rank for v in victims), sum(_cost(v, now_ms)[1] for v in victims), len(victims))


def _freed(gpu: GpuSlot, victim_ids: set[int]) -> bool:
    return bool(gpu.holders) and all(job in victim_ids for _, _, job in gpu.holders)


def _whole_room(gpus: list[GpuSlot], victim_ids: set[int]) -> int:
    return sum(1 for g in gpus if g.idle or _freed(g, victim_ids))


def _slice_room(gpu: GpuSlot, victim_ids: set[int], request: Request) -> bool:
    if gpu.dedicated:
        if not _freed(gpu, victim_ids):
            return False
        free, memory = WHOLE, gpu.memory_mb
    else:
        freed = sum(milli for _, milli, job in gpu.holders if job in victim_ids)
        free = WHOLE - gpu.used_milli + freed
        memory = gpu.memory_mb - gpu.used_memory_mb + freed * gpu.memory_mb // WHOLE
    return free >= request.share_milli and memory >= slice_memory(gpu, request)


def _make_room(victims: list[Running], gpus: list[GpuSlot], fits) -> list[Running] | None:
    """Add victims (cheapest first) until ``fits``; then drop any that were not needed."""
    on_gpus = {job for g in gpus for _, _, job in g.holders}
    useful = [v for v in victims if v.job_id in on_gpus]
    if fits(set()) or not useful:
        return None  # nothing to preempt here (it fits already, or nobody to stop)
    chosen: list[Running] = []
    for victim in useful:
        chosen.append(victim)
        if fits({v.job_id for v in chosen}):
            break
    else:
        return None
    for victim in reversed(chosen[:-1]):
        rest = [v for v in chosen if v is not victim]
        if fits({v.job_id for v in rest}):
            chosen = rest
    return chosen
