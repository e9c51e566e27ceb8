"""Property tests of the pure core over random fleets, running jobs and queues."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.placement import (
    WHOLE,
    GpuSlot,
    Limits,
    NodeSlot,
    Policy,
    Request,
    Running,
    plan,
    usage_accumulate,
    usage_decay,
)

MODELS = [("H100-80GB", 81920), ("L4-24GB", 24576)]
PREEMPT = {"serving": frozenset({"preemptible"}), "standard": frozenset({"preemptible"})}
CLASS_OF_RANK = {300: "serving", 200: "standard", 100: "preemptible"}


@st.composite
def fleets(draw) -> list[NodeSlot]:
    nodes = []
    for n in range(draw(st.integers(1, 6))):
        model, memory = draw(st.sampled_from(MODELS))
        name = f"n{n}"
        gpus = [
            GpuSlot(
                uuid=f"{name}-g{i}",
                node=name,
                model=model,
                memory_mb=memory,
                reservation=draw(st.sampled_from(["any", "any", "any", "dedicated_only", "shared_only"])),
                healthy=bool(i) or draw(st.sampled_from([True, True, False])),
            )
            for i in range(draw(st.integers(1, 8)))
        ]
        nodes.append(NodeSlot(name=name, gpus=gpus, schedulable=draw(st.sampled_from([True, True, True, False]))))
    return nodes


@st.composite
def requests(draw, first_id: int = 1, max_size: int = 40) -> list[Request]:
    out = []
    for i in range(draw(st.integers(0, max_size))):
        shared = draw(st.booleans())
        rank = draw(st.sampled_from([100, 200, 300]))
        out.append(
            Request(
                job_id=first_id + i,
                tenant=draw(st.sampled_from("abc")),
                rank=rank,
                priority=CLASS_OF_RANK[rank],
                submitted_ms=draw(st.integers(0, 1000)),
                shared=shared,
                count=1 if shared else draw(st.integers(1, 8)),
                share_milli=draw(st.one_of(st.sampled_from([125, 250, 500]), st.integers(1, 1000)))
                if shared
                else WHOLE,
                gpu_model=draw(st.sampled_from(["", "", "", "H100-80GB", "L4-24GB"])),
                gpu_memory_mb=draw(st.sampled_from([0, 0, 0, 8000, 30000])),
                max_runtime_ms=draw(st.sampled_from([0, 10_000, 1_000_000])),
            )
        )
    return out


limits_strategy = st.dictionaries(
    st.sampled_from("abc"),
    st.builds(
        Limits,
        dedicated_gpus=st.one_of(st.none(), st.integers(0, 10)),
        shared_milli=st.one_of(st.none(), st.integers(0, 2000)),
    ),
)


def running_from(nodes: list[NodeSlot], initial: list[Request], now_ms: int, stopping: set[int]) -> list[Running]:
    """Place ``initial`` on an empty copy of the fleet and call the result the running jobs."""
    decided = plan(copy.deepcopy(nodes), initial, policy=Policy(now_ms=0))
    by_id = {r.job_id: r for r in initial}
    return [
        Running(
            job_id=p.job_id,
            tenant=by_id[p.job_id].tenant,
            rank=by_id[p.job_id].rank,
            node=p.node,
            gpu_uuids=p.gpu_uuids,
            share_milli=p.share_milli,
            started_ms=0,
            end_ms=50_000 + p.job_id * 1000,
            priority=by_id[p.job_id].priority,
            preemptible=by_id[p.job_id].rank == 100,
            min_runtime_ms=60_000 if p.job_id % 3 == 0 else 0,
            stopping=p.job_id in stopping,
            gpu_memory_mb=by_id[p.job_id].gpu_memory_mb if by_id[p.job_id].shared else 0,
        )
        for p in decided.placements
    ]


def check_invariants(nodes, running, queue, result, policy):
    gpus = {g.uuid: (n, g) for n in nodes for g in n.gpus}
    by_id = {r.job_id: r for r in queue}
    holders: dict[str, list[tuple[int, int]]] = defaultdict(list)
    memory: dict[str, int] = defaultdict(int)
    for job in running:
        for uuid in job.gpu_uuids:
            holders[uuid].append((job.job_id, job.share_milli))
            if job.share_milli < WHOLE:
                memory[uuid] += job.gpu_memory_mb or job.share_milli * gpus[uuid][1].memory_mb // WHOLE
    placed = set()
    for p in result.placements:
        request = by_id[p.job_id]
        placed.add(p.job_id)
        assert len(set(p.gpu_uuids)) == len(p.gpu_uuids) == request.count
        for uuid in p.gpu_uuids:
            node, gpu = gpus[uuid]
            assert node.name == p.node, "a gang spans one node"
            assert node.schedulable and gpu.healthy
            assert not request.models or gpu.model in request.models
            if request.shared:
                assert p.share_milli == request.share_milli
                assert gpu.reservation != "dedicated_only"
                memory[uuid] += request.gpu_memory_mb or request.share_milli * gpu.memory_mb // WHOLE
            else:
                assert p.share_milli == WHOLE
                assert gpu.reservation != "shared_only"
                assert gpu.memory_mb >= request.gpu_memory_mb
            holders[uuid].append((p.job_id, p.share_milli))
    for uuid, held in holders.items():
        assert sum(share for _, share in held) <= WHOLE, f"{uuid} over-allocated: {held}"
        if any(share == WHOLE for _, share in held):
            assert len(held) == 1, f"{uuid} is both dedicated and sliced (or held twice): {held}"
        assert memory[uuid] <= gpus[uuid][1].memory_mb or not any(j in placed for j, _ in held)
    assert placed.isdisjoint(result.pending)
    assert placed | set(result.pending) == set(by_id)
    # Tenant limits: a placement never takes a tenant over its limit.
    for tenant, limits in policy.limits.items():
        ded = sum(len(j.gpu_uuids) for j in running if j.tenant == tenant and j.share_milli == WHOLE)
        shr = sum(j.share_milli for j in running if j.tenant == tenant and j.share_milli < WHOLE)
        new = [by_id[j] for j in placed if by_id[j].tenant == tenant]
        if limits.dedicated_gpus is not None and any(not r.shared for r in new):
            assert ded + sum(r.count for r in new if not r.shared) <= limits.dedicated_gpus
        if limits.shared_milli is not None and any(r.shared for r in new):
            assert shr + sum(r.share_milli for r in new if r.shared) <= limits.shared_milli
    # Victims are lower-class, preemptible, old enough, not already stopping, each chosen once.
    running_by_id = {j.job_id: j for j in running}
    victims = [v.victim_id for v in result.preemptions]
    assert len(victims) == len(set(victims))
    for v in result.preemptions:
        victim, requester = running_by_id[v.victim_id], by_id[v.for_job_id]
        assert victim.preemptible and not victim.stopping and victim.rank < requester.rank
        assert policy.now_ms - victim.started_ms >= victim.min_runtime_ms
        assert v.for_job_id in result.pending


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), requests(first_id=1000, max_size=15), requests(), limits_strategy, st.booleans(), st.data())
def test_plans_never_break_the_invariants(nodes, initial, queue, limits, backfill, data):
    stopping = set(data.draw(st.sets(st.sampled_from([r.job_id for r in initial] or [0]))))
    running = running_from(nodes, initial, 0, stopping)
    policy = Policy(
        now_ms=100_000, limits=limits, may_preempt=PREEMPT, backfill=backfill, weights={"a": 1, "b": 2, "c": 3}
    )
    result = plan(copy.deepcopy(nodes), queue, running=running, policy=policy)
    check_invariants(nodes, running, queue, result, policy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), requests(first_id=1000, max_size=15), requests(), st.booleans())
def test_a_higher_class_is_never_held_back_by_a_lower_one(nodes, initial, queue, backfill):
    """Removing every job of lower classes changes nothing for the higher ones."""
    running = running_from(nodes, initial, 0, set())
    policy = Policy(now_ms=100_000, may_preempt=PREEMPT, backfill=backfill)
    full = plan(copy.deepcopy(nodes), queue, running=running, policy=policy)
    for rank in (300, 200):
        alone = plan(copy.deepcopy(nodes), [r for r in queue if r.rank >= rank], running=running, policy=policy)
        kept = {r.job_id for r in queue if r.rank >= rank}
        assert {p for p in full.placements if p.job_id in kept} == set(alone.placements)
        assert {p for p in full.preemptions if p.for_job_id in kept} == set(alone.preemptions)


def simulate_shares(weights: dict[str, float], *, gpus: int, job_ms: int, steps: int, half_life_ms: int) -> dict:
    """Both tenants always have work queued; jobs of one GPU run ``job_ms``; measure GPU time per tenant."""
    nodes = [
        NodeSlot(
            name="n", gpus=[GpuSlot(uuid=f"g{i}", node="n", model="H100-80GB", memory_mb=81920) for i in range(gpus)]
        )
    ]
    usage = dict.fromkeys(weights, 0.0)
    running: list[Running] = []
    got = dict.fromkeys(weights, 0)
    next_id = 1
    now = 0
    tick = job_ms // 4
    for _ in range(steps):
        running = [r for r in running if r.end_ms > now]
        queue = []
        for tenant in weights:
            for _ in range(gpus):
                queue.append(Request(job_id=next_id, tenant=tenant, rank=200, submitted_ms=next_id, shared=False))
                next_id += 1
        policy = Policy(now_ms=now, weights=weights, usage=usage, half_life_ms=half_life_ms)
        result = plan(copy.deepcopy(nodes), queue, running=running, policy=policy)
        by_id = {r.job_id: r for r in queue}
        for p in result.placements:
            length = job_ms + (p.job_id % 5) * tick // 2  # uneven lengths: ends do not all coincide
            running.append(
                Running(
                    job_id=p.job_id,
                    tenant=by_id[p.job_id].tenant,
                    rank=200,
                    node="n",
                    gpu_uuids=p.gpu_uuids,
                    share_milli=WHOLE,
                    started_ms=now,
                    end_ms=now + length,
                )
            )
        for tenant in weights:
            held = sum(r.milli for r in running if r.tenant == tenant)
            usage[tenant] = usage_accumulate(usage[tenant], milli=held, duration_ms=tick, half_life_ms=half_life_ms)
            got[tenant] += held * tick
        now += tick
    total = sum(got.values())
    return {t: got[t] / total for t in got}


@pytest.mark.parametrize("gpus", [4, 7, 16])
@pytest.mark.parametrize("weights", [(1, 3), (1, 1), (2, 3), (1, 4)])
def test_fair_share_converges_to_the_weights(weights, gpus):
    w = {"a": weights[0], "b": weights[1]}
    shares = simulate_shares(w, gpus=gpus, job_ms=4000, steps=200, half_life_ms=20_000)
    for tenant, weight in w.items():
        assert abs(shares[tenant] - weight / sum(w.values())) <= 0.05, shares


def test_usage_decays_by_half_each_half_life():
    assert usage_decay(1000.0, elapsed_ms=10, half_life_ms=10) == 500.0
    steady = usage_accumulate(0.0, milli=1000, duration_ms=10**9, half_life_ms=1000)
    assert abs(steady - 1000 * 1000 / 0.6931471805599453) < 1e-6
