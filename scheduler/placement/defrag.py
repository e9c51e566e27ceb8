"""Defragmentation: move a few slices so that a job waiting only on their spread can start.

A gang (several whole GPUs) or a job of a higher class than the slices in its
way may wait although the fleet has the room, because slices sit one or two
per card on the cards it needs. :func:`defrag_decide` looks at the fleet as
:func:`.plan` left it (``holders`` filled) and the jobs the plan left waiting
on capacity (``Plan.blocked``, in queue order), and for the first that a move
helps, picks the fewest slices to move. A move is decided only when all hold:

- every slice moved is *movable*: of a preemptible class, or a replica of an
  endpoint with more than one serving replica (at most all but one of them
  move); past its class's minimum runtime; and neither it nor (a replica) its
  endpoint was moved within ``min_interval_ms`` (the disturbance bound);
- once they are gone the job fits on the cards they free (GPUs promised to
  another waiting job, or already being freed, are not touched);
- every moved slice fits somewhere else, on room the queue left: not on the
  freed cards, nor on a GPU promised to a waiting job;
- it pays: the job would otherwise wait at least ``min_gain_ms`` longer than
  the moved slices take to stop (``grace_ms``).

When no move is allowed now only because of the disturbance bound or a
minimum runtime, the answer says when one will be (``at_ms``), so the
estimated start counts the move instead of the end of the slices' runtimes.

The pass drains the moved slices with their class's grace period and queues
them again; the freed cards are claimed for the waiting job
(``Policy.claims``) until it starts. Pure and deterministic: plain data in and
out, every choice ordered by explicit keys.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .data import DEDICATED_ONLY, SHARED_ONLY, WHOLE, GpuSlot, NodeSlot, Request, Running, mig_need
from .fleet import slice_memory

CANDIDATES_CHECKED = 16  # cheapest sets of cards whose slices' new places are looked for, per waiting job


@dataclass(frozen=True)
class Movable:
    """What the defragmenter knows of a running slice besides its :class:`Running` row."""

    ask: Request  # what it asks for when it is placed again (model, memory, size)
    endpoint: int | None = None  # a replica of this endpoint
    replicas: int = 0  # the endpoint's serving replicas


@dataclass(frozen=True)
class DefragPolicy:
    now_ms: int
    min_interval_ms: int = 30 * 60 * 1000  # a job, or an endpoint's replicas, is moved at most once per this
    min_gain_ms: int = 10 * 60 * 1000  # moves pay only if the job would otherwise wait this much longer
    grace_ms: int = 30_000  # moved slices are gone within this (their class's grace period)
    waiting_checked: int = 8  # blocked jobs looked at per decision (queue order)


@dataclass(frozen=True)
class Move:
    job_id: int
    node: str
    gpu_uuid: str  # where it runs now
    to_gpu: str  # a place it fits once moved (the core places it again, maybe elsewhere)


@dataclass(frozen=True)
class Defrag:
    """Move ``moves`` so that ``for_job_id`` can start on ``gpu_uuids`` of ``node``."""

    for_job_id: int
    node: str
    gpu_uuids: tuple[str, ...]
    moves: tuple[Move, ...]
    reason: str
    at_ms: int  # when the moves may start: now, or later when the disturbance bound holds them back
    start_ms: int  # the waiting job's expected start: at_ms + grace


@dataclass
class _Slice:
    running: Running
    movable: Movable
    gpu: str
    allowed_ms: int  # from when it may be moved


def defrag_decide(
    nodes: Sequence[NodeSlot],
    waiting: Sequence[Request],
    running: Sequence[Running],
    movable: Mapping[int, Movable],
    *,
    policy: DefragPolicy,
    moved_ms: Mapping[int, int] | None = None,
    endpoint_moved_ms: Mapping[int, int] | None = None,
    estimates: Mapping[int, int] | None = None,
    reserved: Mapping[str, int] | None = None,
) -> Defrag | None:
    """The move that lets the first job of ``waiting`` (in that order) that a move helps start, with the fewest
    slices moved; ``None`` when no job is helped.

    ``nodes``: the fleet as :func:`.plan` left it. ``running``: the jobs holding GPUs; only those in
    ``movable`` may move. ``moved_ms`` / ``endpoint_moved_ms``: when each job / endpoint was last moved.
    ``estimates``: each waiting job's estimated start without a move (missing: never). ``reserved``: GPUs
    promised to waiting jobs (``Plan.reserved``, open claims included), GPU uuid -> job id. ``waiting``: the
    jobs the plan left waiting on capacity (``Plan.blocked``), in queue order.
    """
    now = policy.now_ms
    moved_ms = moved_ms or {}
    endpoint_moved_ms = endpoint_moved_ms or {}
    estimates = estimates or {}
    reserved = reserved or {}
    slices = _slices(running, movable, policy, moved_ms, endpoint_moved_ms)
    if not slices:
        return None
    stopping = {r.job_id for r in running if r.stopping}
    fleet_order = {n.name: i for i, n in enumerate(nodes)}
    # Where moved slices may go: GPUs open to slices with room left (few on a busy fleet), least room first.
    room = sorted(
        (gpu.free_milli, order, index, node, gpu)
        for order, node in enumerate(nodes)
        if node.schedulable
        for index, gpu in enumerate(node.gpus)
        if gpu.healthy and not gpu.dedicated and gpu.free_milli > 0 and gpu.reservation != DEDICATED_ONLY
    )
    fits_now: dict[tuple, bool] = {}
    no_move: set[tuple] = set()  # (shape, rank, horizon) searched without a move found
    promised = set(reserved.values())
    looked = 0
    later: Defrag | None = None
    for request in defrag_candidates(waiting, running, policy=policy, estimates=estimates):
        if looked >= policy.waiting_checked:
            break
        looked += 1
        estimate = estimates.get(request.job_id)
        shape = request.shape()
        if shape not in fits_now:
            fits_now[shape] = _fits_now(nodes, request, stopping)
        if fits_now[shape]:
            continue  # it waits for something else (a reservation ahead of it), not for the spread
        gang = not request.shared and request.count >= 2
        rank_ok = [s for s in slices if gang or s.running.rank < request.rank]
        own = request.job_id in promised  # GPUs promised to it: its search differs from its shape's
        for horizon in (now, None):  # moves allowed now; else the first time some are
            key = (shape, None if gang else request.rank, horizon)
            if not own and key in no_move:
                continue
            usable = [s for s in rank_ok if horizon is None or s.allowed_ms <= horizon]
            found = _search(nodes, room, request, usable, stopping, reserved, fleet_order)
            if found is None:
                no_move.add(key)
                continue
            node, chosen, moves = found
            at = max([now] + [s.allowed_ms for s in _moved(moves, usable)])
            decision = Defrag(
                for_job_id=request.job_id,
                node=node,
                gpu_uuids=tuple(g.uuid for g in chosen),
                moves=moves,
                reason=_reason(request, node, chosen, moves),
                at_ms=at,
                start_ms=at + policy.grace_ms,
            )
            if at <= now:
                return decision
            if later is None and (estimate is None or decision.start_ms + policy.min_gain_ms <= estimate):
                later = decision
            break
    return later


def defrag_candidates(
    waiting: Sequence[Request],
    running: Sequence[Running],
    *,
    policy: DefragPolicy,
    estimates: Mapping[int, int] | None = None,
) -> list[Request]:
    """The waiting jobs a move might help (cheap, before anything else is read): GPU jobs that are gangs or
    rank above some running slice, and would otherwise wait at least ``min_gain_ms`` past the grace period."""
    estimates = estimates or {}
    lowest = min((r.rank for r in running if r.share_milli < WHOLE and not r.stopping), default=None)
    if lowest is None:
        return []
    found = []
    for request in waiting:
        if not (request.shared or request.count):
            continue
        if (request.shared or request.count < 2) and request.rank <= lowest:
            continue
        estimate = estimates.get(request.job_id)
        if estimate is not None and estimate - (policy.now_ms + policy.grace_ms) < policy.min_gain_ms:
            continue  # it starts soon enough without a move
        found.append(request)
    return found


def _moved(moves: Sequence[Move], slices: Sequence[_Slice]) -> list[_Slice]:
    ids = {m.job_id for m in moves}
    return [s for s in slices if s.running.job_id in ids]


def _slices(running, movable, policy: DefragPolicy, moved_ms, endpoint_moved_ms) -> list[_Slice]:
    """The running slices that may ever move, with the time from which each may."""
    found = []
    for job in running:
        info = movable.get(job.job_id)
        if info is None or job.stopping or job.share_milli >= WHOLE or len(job.gpu_uuids) != 1:
            continue
        if not job.preemptible and not (info.endpoint is not None and info.replicas > 1):
            continue
        allowed = job.started_ms + job.min_runtime_ms
        if job.job_id in moved_ms:
            allowed = max(allowed, moved_ms[job.job_id] + policy.min_interval_ms)
        if info.endpoint is not None and info.endpoint in endpoint_moved_ms:
            allowed = max(allowed, endpoint_moved_ms[info.endpoint] + policy.min_interval_ms)
        found.append(_Slice(job, info, job.gpu_uuids[0], allowed))
    found.sort(key=lambda s: s.running.job_id)
    return found


def _eligible_gpu(gpu: GpuSlot, request: Request) -> bool:
    if not gpu.healthy or (request.models and gpu.model not in request.models):
        return False
    if request.shared:
        return gpu.reservation != DEDICATED_ONLY and gpu.mig is None and gpu.memory_mb >= slice_memory(gpu, request)
    return gpu.reservation != SHARED_ONLY and gpu.memory_mb >= request.gpu_memory_mb


def _leaving(gpu: GpuSlot, stopping: set[int]) -> bool:
    return bool(gpu.holders) and all(job in stopping for _, _, job in gpu.holders)


def _fits_now(nodes: Sequence[NodeSlot], request: Request, stopping: set[int]) -> bool:
    """Whether the request fits on free (or freeing) room, reservations aside: then it does not wait on
    the spread of slices."""
    for node in nodes:
        if not node.schedulable or not node.host_fits(request.cpu_milli, request.memory_mib):
            continue
        counts: dict[str, int] = {}
        for gpu in node.gpus:
            if not _eligible_gpu(gpu, request):
                continue
            if request.shared:
                if not gpu.dedicated and gpu.free_milli >= request.share_milli:
                    if gpu.memory_mb - gpu.used_memory_mb >= slice_memory(gpu, request):
                        return True
            elif gpu.idle or _leaving(gpu, stopping):
                counts[gpu.model] = counts.get(gpu.model, 0) + 1
                if counts[gpu.model] >= request.count:
                    return True
    return False


def _search(nodes, room, request, slices, stopping, reserved, fleet_order):
    """The cheapest (fewest moves, then least moved, then the fleet's order) set of cards on one node that the
    request fits on once slices move, whose moved slices all fit elsewhere."""
    on_gpu: dict[str, list[_Slice]] = {}
    for s in slices:
        on_gpu.setdefault(s.gpu, []).append(s)
    if not on_gpu:
        return None
    candidates = []
    holding = {s.running.node for s in slices}
    for node in nodes:
        if node.name not in holding or not node.schedulable:
            continue
        if not node.host_fits(request.cpu_milli, request.memory_mib):
            continue
        if request.shared:
            for index, gpu in enumerate(node.gpus):
                taken = _room_moves(gpu, request, on_gpu, stopping, reserved)
                if taken:
                    key = (len(taken), sum(s.running.share_milli for s in taken), fleet_order[node.name], index)
                    candidates.append((key, node.name, [gpu], taken))
            continue
        by_model: dict[str, list[tuple[tuple, GpuSlot, list[_Slice]]]] = {}
        for index, gpu in enumerate(node.gpus):
            taken = _clear_moves(gpu, request, on_gpu, stopping, reserved)
            if taken is not None:
                key = (len(taken), sum(s.running.share_milli for s in taken), index)
                by_model.setdefault(gpu.model, []).append((key, gpu, taken))
        for model in sorted(by_model):
            options = sorted(by_model[model], key=lambda o: o[0])[: request.count]
            if len(options) < request.count:
                continue
            taken = [s for _, _, t in options for s in t]
            if not taken:
                continue  # it fits without a move (on cards being freed): nothing to do
            key = (len(taken), sum(s.running.share_milli for s in taken), fleet_order[node.name], model)
            candidates.append((key, node.name, [g for _, g, _ in options], taken))
    candidates.sort(key=lambda c: c[0])
    for _, node_name, chosen, taken in candidates[:CANDIDATES_CHECKED]:
        if not _replicas_kept(taken):
            continue
        places = _replace(nodes, room, taken, {g.uuid for g in chosen}, reserved)
        if places is None:
            continue
        moves = tuple(
            Move(job_id=s.running.job_id, node=s.running.node, gpu_uuid=s.gpu, to_gpu=places[s.running.job_id])
            for s in sorted(taken, key=lambda s: s.running.job_id)
        )
        return node_name, chosen, moves
    return None


def _clear_moves(gpu: GpuSlot, request: Request, on_gpu, stopping, reserved) -> list[_Slice] | None:
    """The slices to move to empty ``gpu`` for a whole-GPU job (None: it cannot be emptied)."""
    if not _eligible_gpu(gpu, request) or reserved.get(gpu.uuid, request.job_id) != request.job_id:
        return None
    if gpu.idle:
        return []
    here = {s.running.job_id: s for s in on_gpu.get(gpu.uuid, ())}
    taken = []
    for _, _, job in gpu.holders:
        if job in stopping:
            continue
        if job not in here:
            return None
        taken.append(here[job])
    return taken


def _room_moves(gpu: GpuSlot, request: Request, on_gpu, stopping, reserved) -> list[_Slice] | None:
    """The fewest slices (largest first) to move off ``gpu`` so that the slice ``request`` fits there."""
    if not _eligible_gpu(gpu, request) or gpu.dedicated or gpu.uuid not in on_gpu:
        return None
    if reserved.get(gpu.uuid, request.job_id) != request.job_id:
        return None
    leaving = [(milli, job) for _, milli, job in gpu.holders if job in stopping]
    free = gpu.free_milli + sum(m for m, _ in leaving)
    memory = gpu.memory_mb - gpu.used_memory_mb + sum(_memory(gpu, m, None) for m, _ in leaving)
    need = slice_memory(gpu, request)
    taken = []
    for s in sorted(on_gpu[gpu.uuid], key=lambda s: (-s.running.share_milli, s.running.job_id)):
        if free >= request.share_milli and memory >= need:
            break
        taken.append(s)
        free += s.running.share_milli
        memory += _memory(gpu, s.running.share_milli, s.running)
    if free < request.share_milli or memory < need:
        return None
    return taken


def _memory(gpu: GpuSlot, milli: int, job: Running | None) -> int:
    """GPU memory a slice holds (as the core counts it)."""
    return (job.gpu_memory_mb if job else 0) or milli * gpu.memory_mb // WHOLE


def _replicas_kept(taken: list[_Slice]) -> bool:
    """Every endpoint keeps at least one serving replica."""
    per_endpoint: dict[int, int] = {}
    for s in taken:
        if s.movable.endpoint is not None and not s.running.preemptible:
            per_endpoint[s.movable.endpoint] = per_endpoint.get(s.movable.endpoint, 0) + 1
    replicas = {s.movable.endpoint: s.movable.replicas for s in taken}
    return all(count <= replicas[endpoint] - 1 for endpoint, count in per_endpoint.items())


def _replace(nodes, room, taken: list[_Slice], freed: set[str], reserved) -> dict[int, str] | None:
    """A place for each moved slice (largest first, best fit), not on the freed cards nor on GPUs promised to
    a waiting job; None when one has nowhere to go."""
    left: dict[str, list] = {}  # uuid -> [free milli, free memory, free MIG instances], as slices go there
    places: dict[int, str] = {}
    for s in sorted(taken, key=lambda s: (-s.running.share_milli, s.running.job_id)):
        ask = s.movable.ask
        # the first GPU, least room first, with room for it now (a best fit unless an earlier slice went there)
        for _, _, _, node, gpu in room[bisect_left(room, (ask.share_milli,)) :]:
            if gpu.uuid in freed or gpu.uuid in reserved or not _eligible_slot(gpu, ask):
                continue
            if not node.host_fits(ask.cpu_milli, ask.memory_mib):
                continue
            state = left.get(gpu.uuid)
            if state is None:
                state = [gpu.free_milli, gpu.memory_mb - gpu.used_memory_mb, list(gpu.mig_free)]
            need = slice_memory(gpu, ask)
            if state[0] < ask.share_milli or state[1] < need:
                continue
            if gpu.mig is not None and not any(m >= mig_need(gpu, ask.share_milli) for m, _ in state[2]):
                continue
            break
        else:
            return None
        state[0] -= ask.share_milli
        state[1] -= need
        if gpu.mig is not None:
            state[2].remove(next(i for i in state[2] if i[0] >= mig_need(gpu, ask.share_milli)))
        left[gpu.uuid] = state
        places[s.running.job_id] = gpu.uuid
    return places


def _eligible_slot(gpu: GpuSlot, ask: Request) -> bool:
    if not gpu.healthy or gpu.reservation == DEDICATED_ONLY or (ask.models and gpu.model not in ask.models):
        return False
    return gpu.memory_mb >= slice_memory(gpu, ask)


def _reason(request: Request, node: str, chosen: list[GpuSlot], moves: tuple[Move, ...]) -> str:
    what = (
        f"{request.share_milli / WHOLE:g} of a {chosen[0].model}"
        if request.shared
        else f"{request.count} x {chosen[0].model}"
    )
    jobs = ", ".join(str(m.job_id) for m in moves)
    return (
        f"defragmentation: {len(moves)} slice(s) (job {jobs}) moved off {len(chosen)} GPU(s) on {node} "
        f"so that job {request.job_id} ({what}) can start; each fits elsewhere"
    )
