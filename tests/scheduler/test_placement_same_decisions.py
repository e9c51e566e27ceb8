"""The placement core's speed-ups change no decision: seeded random replays against decisions recorded with
the core before them (first at commit 1fe8614, the scarcity-aware core of #17 before its speed work; recorded
again, deliberately, when the mix's gang classes changed: every gang class kept, CPU in quarter-octaves,
scarce at 3/4 of the places, measured on the openb sweep as no worse; and again in session 7, when a slice
that leaves the room on its GPU without the CPU the mix's slices need began to rank half a fit later).

Each scenario is a random fleet (60 to 700 nodes, several models, two of them alike in memory and price so
that ties between models matter, nodes with more than one model, 1 to 8 GPUs, tracked and untracked host CPU
and memory, reserved and unhealthy GPUs, unschedulable nodes) and a random stream of requests (exact slices and rounded
ones, gangs that ask for much CPU, CPU-only work, jobs that name models, GPU memory). It is replayed two
ways: online, one request at a time (``Session``: what the packing benchmark measures), and as a whole queue
over running jobs (``plan``: ranks, tenants, backfill reservations, models waiting jobs name).

The recorded decisions live in ``data/placement_decisions.json``; to record them again from a core known to
be right: ``python -m tests.scheduler.test_placement_same_decisions > tests/scheduler/data/placement_decisions.json``
(never from a core under change: that would only compare it with itself).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from scheduler.placement import DEDICATED_ONLY, SHARED_ONLY, GpuSlot, NodeSlot, Policy, Request, Running, Session, plan

RECORDED = Path(__file__).parent / "data" / "placement_decisions.json"
SEEDS = (1, 2, 3, 4, 5, 6, 7, 8)
UNRESERVED = (7, 8)  # fleets with no GPU reserved for one use (the core keeps one idle index for both)
# name, memory; "twin" is like "mid" in memory (and price when priced): the core must break their ties alike
MODELS = (("big", 81920), ("mid", 24576), ("twin", 24576), ("old", 16384), ("edge", 15360))


def random_fleet(rng: random.Random, size: int, *, reserved: bool = True) -> list[NodeSlot]:
    nodes = []
    for i in range(size):
        name = f"n{i:03d}"
        count = rng.choice((1, 2, 2, 4, 8, 8))
        models = [rng.choice(MODELS)]
        if count >= 2 and rng.random() < 0.15:
            models.append(rng.choice(MODELS))  # a node with two models
        gpus = []
        for g in range(count):
            model, memory = models[g * len(models) // count]
            gpus.append(
                GpuSlot(
                    uuid=f"{name}/{g}",
                    node=name,
                    model=model,
                    memory_mb=memory,
                    reservation=rng.choices(("any", DEDICATED_ONLY, SHARED_ONLY), (0.9, 0.05, 0.05))[0]
                    if reserved
                    else "any",
                    healthy=rng.random() > 0.03,
                )
            )
        tracked = rng.random() < 0.85
        nodes.append(
            NodeSlot(
                name=name,
                gpus=gpus,
                schedulable=rng.random() > 0.03,
                cpu_milli=rng.choice((16000, 32000, 48000, 64000, 96000)) if tracked else 0,
                memory_mib=rng.choice((131072, 262144, 786432)) if tracked and rng.random() < 0.9 else 0,
            )
        )
    if rng.random() < 0.5:  # CPU-only nodes at the end of the fleet
        nodes += [NodeSlot(name=f"c{i}", cpu_milli=64000, memory_mib=262144) for i in range(rng.randint(1, 5))]
    return nodes


def random_request(rng: random.Random, job_id: int, *, slices: bool, tenants=("t",), ranks=(0,)) -> Request:
    kind = rng.choices(("share", "one", "gang", "cpu"), (0.4, 0.35, 0.1, 0.15))[0]
    models = ""
    if rng.random() < 0.2:
        models = "|".join(sorted(rng.sample([m for m, _ in MODELS], rng.choice((1, 1, 2)))))
    cpu = rng.choice((0, 1000, 2000, 4000, 8000, 12000, 16000, 24000, 32000, 48000))
    memory = rng.choice((0, 2048, 8192, 32768, 65536, 131072))
    common = dict(
        job_id=job_id,
        tenant=rng.choice(tenants),
        rank=rng.choice(ranks),
        submitted_ms=job_id,
        gpu_model=models,
        cpu_milli=cpu,
        memory_mib=memory,
        max_runtime_ms=rng.choice((0, 3_600_000, 7_200_000, 172_800_000)),
    )
    if kind == "share":
        share = rng.choice((125, 250, 500)) if slices else rng.randint(1, 999)
        return Request(shared=True, share_milli=share, gpu_memory_mb=rng.choice((0, 0, 0, 4096)), **common)
    if kind == "cpu":
        return Request(shared=False, count=0, **{**common, "gpu_model": ""})
    count = 1 if kind == "one" else rng.choice((2, 4, 8))
    if count >= 4:
        common["cpu_milli"] = rng.choice((cpu, 64000, 88000))
    return Request(shared=False, count=count, gpu_memory_mb=rng.choice((0, 0, 0, 20000)), **common)


def prices(rng: random.Random) -> dict[str, float]:
    if rng.random() < 0.5:
        return {}
    mid = rng.choice((0.7, 1.1))
    return {"big": 2.5, "mid": mid, "twin": mid, "old": rng.choice((0.4, 0.7)), "edge": 0.3}


def where(placement) -> str:
    """The node and the GPUs' indexes on it ("n012/0,1"; a CPU-only placement: the node)."""
    gpus = ",".join(uuid.rsplit("/", 1)[1] for uuid in placement.gpu_uuids)
    return f"{placement.node}/{gpus}" if gpus else placement.node


def online(seed: int) -> list:
    """Requests offered one at a time until the demand reaches the fleet's GPUs (the packing replay)."""
    rng = random.Random(seed)
    size = rng.randint(60, 160) if seed % 3 else rng.randint(500, 700)  # a few large fleets
    nodes = random_fleet(rng, size, reserved=seed not in UNRESERVED)
    slices = rng.random() < 0.5
    session = Session(nodes, policy=Policy(now_ms=0, model_price=prices(rng)))
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    decisions, demand, job_id = [], 0, 0
    while demand < capacity * 1.3:
        job_id += 1
        request = random_request(rng, job_id, slices=slices)
        demand += request.milli if (request.shared or request.count) else 0
        placed = session.offer(request)
        decisions.append(where(placed) if placed else session.reason(job_id))
    return decisions


def queue(seed: int) -> dict:
    """A whole queue over running jobs: placements, reasons and estimated starts."""
    rng = random.Random(seed)
    nodes = random_fleet(rng, rng.randint(60, 160), reserved=seed not in UNRESERVED)
    slices = rng.random() < 0.5
    running, job_id = [], 0
    for node in nodes:
        for gpu in node.gpus:
            if node.schedulable and gpu.healthy and rng.random() < 0.6:
                job_id += 1
                share = 1000 if rng.random() < 0.5 else rng.choice((125, 250, 500))
                running.append(
                    Running(
                        job_id=job_id,
                        tenant=rng.choice(("a", "b", "c")),
                        rank=0,
                        node=node.name,
                        gpu_uuids=(gpu.uuid,),
                        share_milli=share,
                        started_ms=0,
                        end_ms=rng.choice((3_600_000, 36_000_000, 360_000_000)),
                    )
                )
    requests = [
        random_request(rng, 10_000 + i, slices=slices, tenants=("a", "b", "c"), ranks=(0, 0, 100))
        for i in range(rng.randint(300, 500))
    ]
    recent = tuple(random_request(rng, 20_000 + i, slices=slices) for i in range(rng.randint(0, 200)))
    result = plan(nodes, requests, running=running, policy=Policy(now_ms=0, model_price=prices(rng), recent=recent))
    return {
        "placements": [[p.job_id, where(p)] for p in result.placements],
        "pending": sorted([job, reason] for job, reason in result.pending.items()),
        "estimated": sorted([job, at] for job, at in result.estimated_start_ms.items()),
    }


def record() -> dict:
    return {
        "online": {str(seed): online(seed) for seed in SEEDS},
        "queue": {str(seed): queue(seed) for seed in SEEDS},
    }


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


@pytest.mark.parametrize("seed", SEEDS)
def test_online_replay_makes_the_recorded_decisions(recorded, seed):
    expected = recorded["online"][str(seed)]
    got = online(seed)
    first_difference = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    assert first_difference is None and len(got) == len(expected), (
        f"request {first_difference}: {got[first_difference] if first_difference is not None else len(got)}"
        f" != {expected[first_difference] if first_difference is not None else len(expected)}"
    )
    placed = sum(1 for d in got if d.startswith(("n", "c")) and " " not in d)
    assert placed > len(got) // 2  # most of it is placed: a real replay


@pytest.mark.parametrize("seed", SEEDS)
def test_whole_queue_makes_the_recorded_decisions(recorded, seed):
    got = queue(seed)
    assert got == recorded["queue"][str(seed)]
    assert got["placements"] and got["pending"]


if __name__ == "__main__":
    print(json.dumps(record(), separators=(",", ":")))


@pytest.mark.parametrize("seed", (1, 7))
def test_the_totals_and_bounds_the_core_keeps_match_the_fleet_after_a_replay(seed):
    """What the core keeps up to date as placements land (free capacity per model, idle GPUs per node, each
    bucket's first place in the order and the idle counts with a non-empty bucket) equals what the fleet
    holds, recomputed."""
    rng = random.Random(seed)
    nodes = random_fleet(rng, 120, reserved=seed not in UNRESERVED)
    session = Session(nodes, policy=Policy(now_ms=0))
    for job_id in range(1, 400):
        session.offer(random_request(rng, job_id, slices=False))
    fleet = session._planner.fleet
    hosts = [n for n in nodes if n.gpus and n.schedulable]
    free: dict[str, int] = {}
    idle: dict[str, dict[str, int]] = {}
    for node in hosts:
        for gpu in node.gpus:
            if gpu.healthy:
                free[gpu.model] = free.get(gpu.model, 0) + gpu.free_milli
                if gpu.idle:
                    idle.setdefault(gpu.model, {})[node.name] = idle.get(gpu.model, {}).get(node.name, 0) + 1
    assert fleet.model_free == free and fleet.free_total == sum(free.values())
    assert {m: per_node for m, per_node in fleet.idle_of.items() if per_node} == idle
    assert sum(free.values()) < sum(1000 * len(n.gpus) for n in hosts)  # the replay placed work
    indexes = {id(fleet.idle_dedicated): fleet.idle_dedicated, id(fleet.idle_shared): fleet.idle_shared}
    buckets = [b for index in indexes.values() for per_model in index.buckets.values() for b in per_model]
    buckets += [b for per_model in fleet.room.values() for b in per_model.values()]
    for bucket in buckets:
        orders = [order for entries in bucket.bands.values() for order, _ in entries]
        assert bucket.first == (min(orders) if orders else float("inf"))
    for index in indexes.values():
        for model, per_model in index.buckets.items():
            assert index.counts[model] == [count for count, bucket in enumerate(per_model) if bucket.size]
