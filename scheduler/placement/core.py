"""One scheduling decision over the whole queue: :func:`plan`.

Order: priority rank (higher first); within a rank, the tenant furthest below
its weighted fair share (see :mod:`.fairshare`), re-evaluated after every
placement; then submit time, then job id.

For each request in that order:

1. a tenant limit that would be exceeded holds it (``pending_reason`` names it);
2. a request nothing in the fleet could ever hold waits with that reason;
3. otherwise it is placed if it fits now without using GPUs promised to a job
   ahead of it (dedicated: gang on one node, best fit; shared: best fit onto
   a GPU already shared, else an idle GPU on the busiest node);
4. if not, and its class may preempt: it waits for victims already stopping,
   or picks the cheapest victims that make room (:mod:`.preempt`);
5. the first request blocked on capacity gets a reservation at its estimated
   start (its shadow time): later requests may use those GPUs only if they
   end by then (EASY backfill). With backfill off, nothing behind it starts.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from . import fairshare
from .data import (
    DEDICATED_ONLY,
    MIG_FIT,
    SHARED_ONLY,
    WHOLE,
    NodeSlot,
    Placement,
    Plan,
    Policy,
    Preemption,
    Request,
    Running,
    mig_need,
    mig_take,
)
from .fleet import Fleet, slice_memory
from .preempt import victims_choose, victims_eligible
from .timeline import Timeline, earliest_start

HARD = float("-inf")  # a reservation no request can use
CLAIM_WAIT = "waiting for the GPUs that moved slices free for it (defragmentation)"


def queue_order(requests: Iterable[Request]) -> list[Request]:
    """Rank, then submit time, then id: the order without fair share."""
    return sorted(requests, key=lambda r: (-r.rank, r.submitted_ms, r.job_id))


class _Planner:
    def __init__(self, nodes: list[NodeSlot], running: list[Running], policy: Policy):
        self.policy = policy
        self.now = policy.now_ms
        self.running = running
        self.result = Plan()
        self.held_dedicated: dict[str, int] = {}
        self.held_shared: dict[str, int] = {}
        self.held_milli: dict[str, float] = {}
        self.stopping_end: dict[int, float] = {}
        self._apply_running(nodes, running)
        self.fleet = Fleet(nodes, price=policy.model_price)
        self.reserved_for: dict[str, int] = {}  # GPU uuid -> job id it is promised to
        self.head: Request | None = None
        self.head_start: float | None = None
        self.strict_block: int | None = None
        self.taken: set[int] = set()
        self._never: dict[tuple, str] = {}
        self._no_fit: dict[tuple, float] = {}  # shape -> earliest end for which it did not fit
        self._no_fit_anywhere: set[tuple] = set()  # shapes that do not fit even ignoring reservations
        self._stopping_no_help: set[tuple] = set()
        self._preempt_failed: dict[tuple, float] = {}  # shape -> highest rank that found no victims
        self._capacity_blocked: list[Request] = []
        self._behind_head: set[int] = set()
        self._named: dict[int, dict[str, int]] = {}
        self._unlearned: dict[int, list[Request]] = {}
        self._claims_apply()

    # -- state of the fleet and tenants ----------------------------------------
    def _apply_running(self, nodes: list[NodeSlot], running: list[Running]) -> None:
        gpus = {g.uuid: g for n in nodes for g in n.gpus}
        by_name = {n.name: n for n in nodes}
        for gpu in gpus.values():
            if gpu.mig is not None:
                gpu.mig_free = sorted(gpu.mig)
        # MIG instances held by running slices: the smallest that holds each, in start order (as the agent
        # picked them when they launched).
        for job in sorted(running, key=lambda j: (j.started_ms, j.job_id)):
            if job.share_milli < WHOLE and len(job.gpu_uuids) == 1:
                held = gpus.get(job.gpu_uuids[0])
                if held is not None and held.mig is not None:
                    mig_take(held, job.share_milli)
        for job in running:
            for uuid in job.gpu_uuids:
                held = gpus.get(uuid)
                if held is None:
                    continue
                held.holders.append((job.end_ms, job.share_milli, job.job_id))
                held.used_milli += job.share_milli
                held.dedicated = held.dedicated or job.share_milli >= WHOLE
                if job.share_milli < WHOLE:
                    held.used_memory_mb += job.gpu_memory_mb or job.share_milli * held.memory_mb // WHOLE
            node = by_name.get(job.node)
            if node is not None:
                node.used_cpu_milli += job.cpu_milli
                node.used_memory_mib += job.memory_mib
            self._hold(job.tenant, shared=job.share_milli < WHOLE, milli=job.milli)
            if job.stopping:
                self.stopping_end[job.job_id] = self.now + self.policy.preempt_grace_ms

    def _hold(self, tenant: str, *, shared: bool, milli: int) -> None:
        if shared:
            self.held_shared[tenant] = self.held_shared.get(tenant, 0) + milli
        else:
            self.held_dedicated[tenant] = self.held_dedicated.get(tenant, 0) + milli // WHOLE
        self.held_milli[tenant] = self.held_milli.get(tenant, 0) + milli

    def standing(self, tenant: str, asking: Request) -> float:
        """The tenant's standing once ``asking`` (its next job) is granted: lowest goes first."""
        return fairshare.standing(
            usage=self.policy.usage.get(tenant, 0.0),
            held_milli=self.held_milli.get(tenant, 0) + asking.milli / 2,
            weight=self.policy.weights.get(tenant, 1.0),
            half_life_ms=self.policy.half_life_ms,
        )

    # -- the pass --------------------------------------------------------------
    def learn(self, queue: list[Request]) -> None:
        """The workload's mix from the recent requests and the queue; per priority rank, the models that
        constrained jobs of that rank or higher in the queue need. A request is placed against the mix of
        the queue's requests of its rank or higher only (see :meth:`_learn_rank`): a job of a higher class
        is never moved by the wishes of a lower one."""
        fleet = self.fleet
        for request in self.policy.recent:
            fleet.mix.add(request)
        fleet.refresh_mix()
        self._unlearned = {}  # queued requests by rank, added to the mix rank by rank
        for request in queue:
            self._unlearned.setdefault(request.rank, []).append(request)
        # rank -> model -> constrained requests of that rank naming it that are not placed (yet)
        self._named = {}
        for request in queue:
            for model in request.models:
                per_rank = self._named.setdefault(request.rank, {})
                per_rank[model] = per_rank.get(model, 0) + 1

    def _avoid(self, rank: int) -> frozenset[str]:
        """Models that constrained requests of ``rank`` or higher, still waiting, name."""
        return frozenset(m for r, named in self._named.items() if r >= rank for m, n in named.items() if n > 0)

    def _learn_rank(self, rank: int) -> None:
        """Add the queued requests of ``rank`` and above to the mix (once)."""
        higher = [r for r in self._unlearned if r >= rank]
        if not higher:
            return
        for r in higher:
            for request in self._unlearned.pop(r):
                self.fleet.mix.add(request)
        self.fleet.refresh_mix()

    def run(self, requests: Iterable[Request]) -> Plan:
        requests = list(requests)
        self.learn(requests)
        queues: dict[tuple[int, str], list[Request]] = {}
        for request in requests:
            queues.setdefault((request.rank, request.tenant), []).append(request)
        heap = []
        version: dict[str, int] = {}
        for (rank, tenant), queue in queues.items():
            queue.sort(key=lambda r: (r.submitted_ms, r.job_id), reverse=True)  # pop() from the end
            head = queue[-1]
            heap.append((-rank, self.standing(tenant, head), head.submitted_ms, head.job_id, 0, rank, tenant))
        heapq.heapify(heap)
        position = 0
        while heap:
            entry = heapq.heappop(heap)
            _, _, _, _, seen, rank, tenant = entry
            if seen != version.get(tenant, 0):
                head = queues[(rank, tenant)][-1]
                heapq.heappush(
                    heap,
                    (
                        -rank,
                        self.standing(tenant, head),
                        head.submitted_ms,
                        head.job_id,
                        version.get(tenant, 0),
                        rank,
                        tenant,
                    ),
                )
                continue
            queue = queues[(rank, tenant)]
            request = queue.pop()
            position += 1
            self.result.positions[request.job_id] = position
            if self._decide(request):
                version[tenant] = version.get(tenant, 0) + 1
            if queue:
                head = queue[-1]
                heapq.heappush(
                    heap,
                    (
                        -rank,
                        self.standing(tenant, head),
                        head.submitted_ms,
                        head.job_id,
                        version.get(tenant, 0),
                        rank,
                        tenant,
                    ),
                )
        self._estimate()
        self.result.reserved = dict(self.reserved_for)
        return self.result

    def _decide(self, request: Request) -> bool:
        """Place ``request`` or record why it waits; True when placed."""
        pending = self.result.pending
        reason = self._limit_reason(request)
        if reason:
            pending[request.job_id] = reason
            return False
        if self.strict_block is not None:
            pending[request.job_id] = f"behind job {self.strict_block}, first in line (backfill is off)"
            self._behind_head.add(request.job_id)
            return False
        reason = self._never_reason(request)
        if reason:
            pending[request.job_id] = reason
            return False
        end = self.now + self.policy.runtime_ms(request)
        if self._unlearned:
            self._learn_rank(request.rank)
        self.fleet.avoid = self._avoid(request.rank) if self._named else frozenset()
        if request.job_id in self._claimed:
            return self._place_claimed(request, end)
        if self._place(request, end):
            if request.models and request.rank in self._named:
                named = self._named[request.rank]
                for model in request.models:
                    named[model] -= 1
            return True
        if self._wait_for_stopping(request) or self._preempt(request):
            return False
        self._capacity_blocked.append(request)
        self.result.blocked.append(request.job_id)
        if self.fleet.reserved and self._fits_ignoring_reservations(request):
            owner = self._reservation_owner(request)
            pending[request.job_id] = (
                f"would delay job {owner}, ahead in the queue, which has the free GPUs reserved (backfill)"
            )
            self._behind_head.add(request.job_id)
            return False
        pending[request.job_id] = self._capacity_reason(request)
        if not self.policy.backfill:
            self.strict_block = request.job_id
        elif self.head is None:
            self._reserve_for_head(request)
        return False

    def _place(self, request: Request, end: float) -> bool:
        # Capacity only shrinks and reservations only grow during a pass: a shape
        # that did not fit for jobs ending at E will not fit for jobs ending later.
        shape = request.shape()
        failed_end = self._no_fit.get(shape)
        if failed_end is not None and end >= failed_end:
            return False
        if not self._place_now(request, end):
            self._no_fit[shape] = end if failed_end is None else min(failed_end, end)
            return False
        return True

    def _place_now(self, request: Request, end: float) -> bool:
        fleet = self.fleet
        if request.shared:
            gpu = fleet.find_shared(request, end)
            if gpu is None:
                return False
            fleet.take_share(gpu, request)
            node, gpus = gpu.node, [gpu]
        elif not request.count:  # CPU-only
            found = fleet.find_host(request)
            if found is None:
                return False
            fleet.take_host(found[0], request)
            node, gpus = found[0].name, []
        else:
            found = fleet.find_dedicated(request, end)
            if found is None:
                return False
            node_slot, gpus = found
            fleet.take_whole(node_slot, gpus, request)
            node = node_slot.name
        share = request.share_milli if request.shared else WHOLE
        for gpu in gpus:
            gpu.holders.append((end, share, request.job_id))
        self._hold(request.tenant, shared=request.shared, milli=request.milli)
        self.result.placements.append(Placement(request.job_id, node, tuple(g.uuid for g in gpus), share))
        return True

    # -- reasons -----------------------------------------------------------------
    def _limit_reason(self, request: Request) -> str:
        limits = self.policy.limits.get(request.tenant)
        if limits is None:
            return ""
        if limits.blocked_reason:
            return f"tenant limit: {limits.blocked_reason}"
        if request.shared and limits.shared_milli is not None:
            held = self.held_shared.get(request.tenant, 0)
            if held + request.share_milli > limits.shared_milli:
                return (
                    f"tenant limit: at most {limits.shared_milli / WHOLE:g} GPU in shared slices at once "
                    f"({held / WHOLE:g} in use)"
                )
        if not request.shared and limits.dedicated_gpus is not None:
            held = self.held_dedicated.get(request.tenant, 0)
            if held + request.count > limits.dedicated_gpus:
                return f"tenant limit: at most {limits.dedicated_gpus} dedicated GPUs at once ({held} in use)"
        return ""

    def _never_reason(self, request: Request) -> str:
        shape = request.shape()
        if shape not in self._never:
            self._never[shape] = self._static_reason(request)
        return self._never[shape]

    def _static_reason(self, request: Request) -> str:
        if not request.shared and not request.count:
            if any(
                n.schedulable
                and (not n.cpu_milli or n.cpu_milli >= request.cpu_milli)
                and (not n.memory_mib or n.memory_mib >= request.memory_mib)
                for n in self.fleet.nodes.values()
            ):
                return ""
            return "no schedulable node has the CPU and memory it asks for"
        what = f"{' or '.join(request.models)} GPU" if request.models else "GPU"
        if request.gpu_memory_mb:
            what += f" with {request.gpu_memory_mb} MiB"
        models = set(self.fleet.models_for(request))
        if not models:
            return f"no schedulable {what} in the fleet"
        best = 0
        mig_too_small = False
        for node in self.fleet.nodes.values():
            if not node.schedulable or (node.cpu_milli and node.cpu_milli < request.cpu_milli):
                continue
            if node.memory_mib and node.memory_mib < request.memory_mib:
                continue
            counts: dict[str, int] = {}
            for gpu in node.gpus:
                if gpu.model not in models or not gpu.healthy:
                    continue
                if request.shared:
                    if gpu.mig is not None and max((m for m, _ in gpu.mig), default=0) < mig_need(
                        gpu, request.share_milli
                    ):
                        mig_too_small = True
                        continue
                    if gpu.reservation != DEDICATED_ONLY and gpu.memory_mb >= slice_memory(gpu, request):
                        return ""
                elif gpu.reservation != SHARED_ONLY and gpu.memory_mb >= request.gpu_memory_mb:
                    counts[gpu.model] = counts.get(gpu.model, 0) + 1
            best = max(best, *counts.values(), 0)
            if best >= request.count and not request.shared:
                return ""
        if request.shared:
            if mig_too_small:
                return (
                    f"no MIG instance in the fleet holds a {request.share_milli / WHOLE:g} slice "
                    f"(it needs {MIG_FIT:.0%} of the slice's memory), and no {what} without MIG is open to slices"
                )
            return f"no schedulable {what} is open to shared slices"
        return f"no node has {request.count} {what}s for dedicated use (at most {best} on one node)"

    def _capacity_reason(self, request: Request) -> str:
        if not request.shared and not request.count:
            return "waiting for CPU and memory on a node to free up"
        model = f"{' or '.join(request.models)} " if request.models else ""
        if request.shared:
            profile = self._mig_wait(request)
            if profile:
                return f"no free MIG instance of {profile} or larger"
            return f"waiting for {request.share_milli / WHOLE:g} of a {model}GPU to free up"
        return f"waiting for {request.count} free whole {model}GPU(s) on one node"

    def _mig_wait(self, request: Request) -> str:
        """When every GPU that could take the slice is in MIG mode: the profile of the smallest instance
        that would hold it (the slice waits for one of those to free up); else ""."""
        models = set(self.fleet.models_for(request))
        smallest: tuple[int, str] | None = None
        for node in self.fleet.nodes.values():
            if not node.schedulable:
                continue
            for gpu in node.gpus:
                if gpu.model not in models or not gpu.healthy or gpu.reservation == DEDICATED_ONLY:
                    continue
                if gpu.mig is None:
                    return ""
                need = mig_need(gpu, request.share_milli)
                fits = [i for i in gpu.mig if i[0] >= need]
                if fits and (smallest is None or min(fits) < smallest):
                    smallest = min(fits)
        return smallest[1] if smallest else ""

    def _fits_ignoring_reservations(self, request: Request) -> bool:
        shape = request.shape()
        if shape in self._no_fit_anywhere:
            return False
        if request.shared:
            fits = self.fleet.find_shared(request, HARD) is not None
        else:
            fits = self.fleet.find_dedicated(request, HARD) is not None
        if not fits:
            self._no_fit_anywhere.add(shape)
        return fits

    def _reservation_owner(self, request: Request) -> int:
        for uuid, job in self.reserved_for.items():
            gpu = self.fleet.gpus[uuid]
            if not request.models or gpu.model in request.models:
                return job
        return next(iter(self.reserved_for.values()), 0)

    # -- preemption and backfill reservations ----------------------------------------
    def _reserve(self, request: Request, uuids: Iterable[str], until: float) -> None:
        for uuid in uuids:
            self.fleet.reserved[uuid] = min(self.fleet.reserved.get(uuid, until), until)
            self.reserved_for.setdefault(uuid, request.job_id)

    def _claims_apply(self) -> None:
        """GPUs that moved slices free for a waiting job (:mod:`.defrag`): promised to it, closed to all else."""
        self._claimed = set(self.policy.claims.values())
        for uuid, job in self.policy.claims.items():
            if uuid in self.fleet.gpus:
                self.fleet.reserved[uuid] = HARD
                self.reserved_for[uuid] = job

    def _place_claimed(self, request: Request, end: float) -> bool:
        """Place a job that GPUs are being freed for, with its claimed GPUs open to it; until they are free
        it waits for them (no preemption, no other reservation: the move is its way in)."""
        uuids = [u for u, job in self.policy.claims.items() if job == request.job_id and u in self.fleet.gpus]
        for uuid in uuids:
            del self.fleet.reserved[uuid]
        self._no_fit.pop(request.shape(), None)  # it was learned with these GPUs closed
        if self._place(request, end):
            return True
        for uuid in uuids:
            self.fleet.reserved[uuid] = HARD
        self.result.pending[request.job_id] = CLAIM_WAIT
        return False

    def _wait_for_stopping(self, request: Request) -> bool:
        if not self.stopping_end or not self.policy.may_preempt.get(request.priority):
            return False
        if request.shape() in self._stopping_no_help:
            return False
        found = earliest_start(self.fleet, request, now_ms=self.now, stopping_end=self.stopping_end)
        if found is None or found[0] > self.now + self.policy.preempt_grace_ms:
            self._stopping_no_help.add(request.shape())
            return False
        at, gpus = found
        self._reserve(request, (g.uuid for g in gpus), HARD)
        self.result.pending[request.job_id] = "waiting for preempted lower-priority jobs to stop"
        self.result.estimated_start_ms[request.job_id] = int(at)
        return True

    def _preempt(self, request: Request) -> bool:
        shape = request.shape()
        if self._preempt_failed.get(shape, float("-inf")) >= request.rank:
            return False
        candidates = victims_eligible(request, self.running, self.policy, self.taken)
        found = victims_choose(self.fleet, request, candidates, self.now) if candidates else None
        if found is None:
            self._preempt_failed[shape] = max(self._preempt_failed.get(shape, float("-inf")), request.rank)
            return False
        victims, gpus = found
        for victim in victims:
            self.taken.add(victim.job_id)
            self.result.preemptions.append(Preemption(victim.job_id, request.job_id, victim.node))
        self._reserve(request, (g.uuid for g in gpus), HARD)
        self.result.pending[request.job_id] = f"preempting {len(victims)} lower-priority job(s) to make room"
        self.result.estimated_start_ms[request.job_id] = self.now + self.policy.preempt_grace_ms
        return True

    def _reserve_for_head(self, request: Request) -> None:
        self.head = request
        found = earliest_start(self.fleet, request, now_ms=self.now, stopping_end=self.stopping_end)
        if found is None:
            return
        at, gpus = found
        self.head_start = at
        self._reserve(request, (g.uuid for g in gpus), at)
        self.result.estimated_start_ms[request.job_id] = int(at)

    def _estimate(self) -> None:
        """Earliest start of each job blocked on capacity, if nothing else went first."""
        if not self._capacity_blocked:
            return
        timeline = Timeline(self.fleet, now_ms=self.now, stopping_end=self.stopping_end)
        cache: dict[tuple, float | None] = {}
        estimates = self.result.estimated_start_ms
        for request in self._capacity_blocked:
            if request.job_id in estimates or not (request.shared or request.count):
                continue
            shape = request.shape()
            if shape not in cache:
                cache[shape] = timeline.earliest(request)
            at = cache[shape]
            if at is not None and request.job_id in self._behind_head and self.head_start is not None:
                at = max(at, self.head_start)
            if at is not None:
                estimates[request.job_id] = int(at)


def plan(
    nodes: list[NodeSlot],
    requests: Iterable[Request],
    *,
    running: Iterable[Running] = (),
    policy: Policy | None = None,
) -> Plan:
    """Decide the whole queue at once.

    ``nodes`` describe capacity (their GPUs' ``used_*`` fields may be preset;
    ``running`` jobs are added on top and give the estimated ends, tenants'
    holdings and preemption victims). ``nodes`` are mutated to the planned state.
    """
    return _Planner(nodes, list(running), policy or Policy()).run(requests)


class Session:
    """The core used online, one request at a time, against a fleet it keeps
    (replays and packing benchmarks): the same decisions :func:`plan` makes,
    without rebuilding the fleet's indexes for every arrival."""

    def __init__(self, nodes: list[NodeSlot], *, running: Iterable[Running] = (), policy: Policy | None = None):
        self._planner = _Planner(nodes, list(running), policy or Policy())
        if self._planner.policy.recent:
            self._planner.learn([])

    def offer(self, request: Request) -> Placement | None:
        """Place ``request`` now if it fits (the fleet keeps it), else None (see :meth:`reason`)."""
        placements = self._planner.result.placements
        before = len(placements)
        self._planner.fleet.observe(request)
        self._planner._decide(request)
        return placements[-1] if len(placements) > before else None

    def host_taken(self, node: str, cpu_milli: int, memory_mib: int) -> None:
        """Host CPU and memory used on ``node`` by work placed outside the core."""
        fleet = self._planner.fleet
        fleet.use_host(fleet.nodes[node], cpu_milli, memory_mib)

    def reason(self, job_id: int) -> str:
        return self._planner.result.pending.get(job_id, "")
