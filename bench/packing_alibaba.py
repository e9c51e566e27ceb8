"""Packing production GPU-sharing workloads: Alibaba's openb traces, replayed the FGD way.

    python -m bench.packing_alibaba [--quick] [--variant NAME ...] [--shares exact|slices] [--seeds N]

The method of Weng et al. (USENIX ATC 2023, "Beware of Fragmentation"): draw
tasks at random (fixed seed, with replacement) from a trace and place each as
it arrives, never moving or ending one, until the GPU demand that has arrived
reaches 100% of the cluster's GPUs; report the share of GPU capacity
allocated at that point. Host CPU and memory are respected; ``gpu_spec``
(allowed models) is honoured.

Every workload variant of the release is replayed (``VARIANTS``: default,
gpushare20-100, multigpu20-40, gpuspec05/20 on the GPU-node cluster;
cpu050/100 on the cluster with its CPU-only nodes), with each task's share
exact (1-1000 thousandths) and rounded up to the slices gpushare sells
(1/8, 1/4, 1/2; above 1/2 a whole GPU), mean of 3 seeds.

Policies, in one process on the same draw:

- ``gpushare``: the scheduler's pure core (``scheduler.placement.Session``),
  the same code a scheduling pass runs, learning the workload's mix online
  from the requests it is offered;
- ``first-fit``: first node (in file order) that fits; first GPU with room;
- ``best-fit``: the node left with the least free GPU capacity; on it, the GPU
  with the least room that fits;
- ``fgd``: Fragmentation Gradient Descent as the paper describes it: the
  target workload is the trace's task mix (popularity of each task class);
  a node's fragmentation is the expected GPU capacity (over that mix) that a
  task of the mix could not use there (all of the node's free GPU when the
  task cannot run on it at all: model, CPU, memory or GPUs short; else the
  free GPU of the cards too small for its per-GPU demand); each task goes to
  the node and GPU(s) whose fragmentation grows least.

CPU-only tasks (in every trace; 9-31% of the cores demanded) are placed two
ways: by each policy itself (gpushare's core included: ``Request(count=0)``),
the main figure, and, for continuity with the earlier replay, first-fit in
node-file order for every policy. The replay also checks that no GPU is ever
both held whole and sliced.

The data is read from ``../shared/bench/alibaba-openb`` beside the checkout
(as CI lays it out), or from ``$GPUSHARE_OPENB`` when set.
"""

from __future__ import annotations

import csv
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("GPUSHARE_OPENB") or ROOT.parent / "shared" / "bench" / "alibaba-openb")
SEED = 2023
GPU_NODES = "openb_node_list_gpu_node.csv"
ALL_NODES = "openb_node_list_all_node.csv"
VARIANTS = {  # name -> (task file, node file)
    "default": ("openb_pod_list_default.csv", GPU_NODES),
    "gpushare20": ("openb_pod_list_gpushare20.csv", GPU_NODES),
    "gpushare40": ("openb_pod_list_gpushare40.csv", GPU_NODES),
    "gpushare60": ("openb_pod_list_gpushare60.csv", GPU_NODES),
    "gpushare80": ("openb_pod_list_gpushare80.csv", GPU_NODES),
    "gpushare100": ("openb_pod_list_gpushare100.csv", GPU_NODES),
    "multigpu20": ("openb_pod_list_multigpu20.csv", GPU_NODES),
    "multigpu30": ("openb_pod_list_multigpu30.csv", GPU_NODES),
    "multigpu40": ("openb_pod_list_multigpu40.csv", GPU_NODES),
    "gpuspec05": ("openb_pod_list_gpuspec05.csv", GPU_NODES),
    "gpuspec20": ("openb_pod_list_gpuspec20.csv", GPU_NODES),
    "cpu050": ("openb_pod_list_cpu050.csv", ALL_NODES),
    "cpu100": ("openb_pod_list_cpu100.csv", ALL_NODES),
}
QUICK_VARIANTS = ("default", "multigpu40", "gpuspec20", "cpu100")
POLICIES = ("gpushare", "first-fit", "best-fit", "fgd")
GPU_MEMORY = {"P100": 16384, "T4": 15360, "V100M16": 16384, "V100M32": 32768, "A10": 24576, "G2": 24576, "G3": 32768}


@dataclass
class Node:
    index: int
    name: str
    cpu: int
    memory: int
    model: str
    gpus: list[int]  # used thousandths per GPU
    whole: list[bool]  # held whole by one task
    cpu_used: int = 0
    memory_used: int = 0
    free: int = -1  # free GPU thousandths on the node

    def __post_init__(self):
        self.free = 1000 * len(self.gpus)


@dataclass(frozen=True)
class Task:
    name: str
    cpu: int
    memory: int
    count: int  # GPUs (0: CPU only)
    milli: int  # per GPU
    models: tuple[str, ...]


@dataclass
class Outcome:
    policy: str
    allocated_pct: float = 0.0
    failed: int = 0
    seconds: float = 0.0  # gpushare: wall time inside the core's offer(); baselines: the whole loop
    cpu_seconds: float = 0.0  # CPU time of the whole loop (the replay's own bookkeeping included)
    core_cpu_seconds: float = 0.0  # gpushare: CPU time inside the core's offer() (the goal's figure: load-proof)
    decisions: int = 0
    mixed_gpus: int = 0
    failed_demand: dict = field(default_factory=dict)  # (GPUs, "share" | "whole" | "cpu") -> GPU thousandths not placed


def load_nodes(name: str) -> list[tuple]:
    with open(DATA / name) as f:
        return [
            (r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"]) for r in csv.DictReader(f)
        ]


def load_tasks(name: str) -> list[Task]:
    with open(DATA / name) as f:
        return [
            Task(
                r["name"],
                int(r["cpu_milli"]),
                int(r["memory_mib"]),
                int(r["num_gpu"]),
                int(r["gpu_milli"]) if int(r["num_gpu"]) else 0,
                tuple(m for m in (r.get("gpu_spec") or "").split("|") if m),
            )
            for r in csv.DictReader(f)
        ]


def rounded(task: Task) -> Task:
    if task.count != 1 or task.milli >= 1000 or task.milli == 0:
        return task
    for size in (125, 250, 500):
        if task.milli <= size:
            return Task(task.name, task.cpu, task.memory, 1, size, task.models)
    return Task(task.name, task.cpu, task.memory, 1, 1000, task.models)


def draw(tasks: list[Task], capacity_gpus: int, seed: int) -> list[Task]:
    """Tasks drawn at random until the arrived GPU demand reaches the cluster's capacity."""
    rng = random.Random(seed)
    arrived, demand = [], 0
    while demand < capacity_gpus * 1000:
        task = rng.choice(tasks)
        arrived.append(task)
        demand += task.count * task.milli
    return arrived


# -- first-fit and best-fit (plain Python over the node records) ------------------------------------------
def host_fits(node: Node, task: Task) -> bool:
    return node.cpu_used + task.cpu <= node.cpu and node.memory_used + task.memory <= node.memory


def model_ok(node: Node, task: Task) -> bool:
    return not task.models or node.model in task.models


def gpu_choice(node: Node, task: Task, best: bool) -> list[int] | None:
    if task.count == 0:
        return []
    if task.milli >= 1000:
        idle = [i for i, used in enumerate(node.gpus) if used == 0]
        return idle[: task.count] if len(idle) >= task.count else None
    fits = [i for i, used in enumerate(node.gpus) if not node.whole[i] and 1000 - used >= task.milli]
    if not fits:
        return None
    return [min(fits, key=lambda i: 1000 - node.gpus[i]) if best else fits[0]]


def baseline_place(nodes: list[Node], task: Task, best: bool) -> tuple[Node, list[int]] | None:
    chosen = None
    for node in nodes:
        if task.count and (node.free < task.count * task.milli or not model_ok(node, task)):
            continue
        if not host_fits(node, task):
            continue
        gpus = gpu_choice(node, task, best)
        if gpus is None:
            continue
        if not best:
            return node, gpus
        if task.count:
            left = node.free - task.count * task.milli
        else:  # a CPU-only task: the node left with the least free CPU
            left = node.cpu - node.cpu_used - task.cpu
        if chosen is None or left < chosen[2]:
            chosen = (node, gpus, left)
    return (chosen[0], chosen[1]) if chosen else None


def apply(node: Node, gpus: list[int], task: Task) -> None:
    for i in gpus:
        node.gpus[i] += task.milli
        node.whole[i] = node.whole[i] or task.milli >= 1000
        node.free -= task.milli
    node.cpu_used += task.cpu
    node.memory_used += task.memory


# -- FGD, from the paper's description --------------------------------------------------------------------
def task_classes(tasks: list[Task]) -> list[tuple]:
    """The target workload: task classes (GPUs, per-GPU share bucketed to 1/10, allowed models) with their
    popularity (an integer count) and the median CPU, memory and share of their members."""
    groups: dict[tuple, list[Task]] = {}
    for task in tasks:
        bucket = -(-task.milli // 100) * 100 if task.count == 1 else task.milli
        groups.setdefault((task.count, bucket, task.models), []).append(task)
    classes = []
    for (count, _, models), members in groups.items():
        mid = len(members) // 2
        cpu = sorted(t.cpu for t in members)[mid]
        memory = sorted(t.memory for t in members)[mid]
        milli = sorted(t.milli for t in members)[mid]
        classes.append((len(members), count, milli, cpu, memory, frozenset(models)))
    return classes


class FGD:
    """Nodes grouped by state (model, free CPU, free memory, sorted free shares); the fragmentation of a
    state is cached, so a decision costs one look at each distinct state."""

    def __init__(self, nodes: list[Node], classes: list[tuple]):
        self.classes = classes
        self.frag_cache: dict[tuple, int] = {}
        self.groups: dict[tuple, dict[int, Node]] = {}
        self.key_of: dict[int, tuple] = {}
        for node in nodes:
            self._put(node)

    @staticmethod
    def state(node: Node) -> tuple:
        return (
            node.model,
            node.cpu - node.cpu_used,
            node.memory - node.memory_used,
            tuple(sorted(1000 - u for u in node.gpus)),
        )

    def _put(self, node: Node) -> None:
        key = self.state(node)
        self.key_of[node.index] = key
        self.groups.setdefault(key, {})[node.index] = node

    def frag(self, key: tuple) -> int:
        hit = self.frag_cache.get(key)
        if hit is not None:
            return hit
        model, cpu, memory, frees = key
        total = sum(frees)
        value = 0
        if total:
            idle = frees.count(1000)
            largest = frees[-1] if frees else 0
            for weight, count, milli, c_cpu, c_memory, models in self.classes:
                if cpu < c_cpu or memory < c_memory or (models and model not in models):
                    value += weight * total
                elif count == 0:
                    continue  # a task that needs no GPU can run: none of the free GPU is stranded for it
                elif count == 1 and milli < 1000:
                    value += weight * (total if largest < milli else sum(f for f in frees if f < milli))
                else:
                    value += weight * (total if idle < count else total - 1000 * idle)
        self.frag_cache[key] = value
        return value

    def place(self, task: Task) -> tuple[Node, list[int]] | None:
        best = None  # (delta, node index, key, free share chosen)
        for key, members in self.groups.items():
            model, cpu, memory, frees = key
            if cpu < task.cpu or memory < task.memory:
                continue
            if task.count and (not frees or (task.models and model not in task.models)):
                continue
            before = self.frag(key)
            options = []
            if task.count == 0:
                options.append(((model, cpu - task.cpu, memory - task.memory, frees), None))
            elif task.milli >= 1000:
                idle = frees.count(1000)
                if idle < task.count:
                    continue
                after = tuple(sorted(frees[: len(frees) - idle] + (0,) * task.count + (1000,) * (idle - task.count)))
                options.append(((model, cpu - task.cpu, memory - task.memory, after), 1000))
            else:
                for f in set(frees):
                    if f >= task.milli:
                        rest = list(frees)
                        rest.remove(f)
                        rest.append(f - task.milli)
                        options.append(((model, cpu - task.cpu, memory - task.memory, tuple(sorted(rest))), f))
            for after, free in options:
                delta = self.frag(after) - before
                if best is None or delta <= best[0]:
                    first = min(members)
                    if best is None or delta < best[0] or first < best[1]:
                        best = (delta, first, key, free)
        if best is None:
            return None
        node = self.groups[best[2]][best[1]]
        free = best[3]
        if free is None:
            gpus = []
        elif task.milli >= 1000:
            gpus = [i for i, used in enumerate(node.gpus) if used == 0][: task.count]
        else:
            gpus = [next(i for i, used in enumerate(node.gpus) if 1000 - used == free and not node.whole[i])]
        return node, gpus

    def moved(self, node: Node) -> None:
        """Re-file ``node`` after a placement changed it."""
        old = self.key_of[node.index]
        group = self.groups[old]
        del group[node.index]
        if not group:
            del self.groups[old]
        self._put(node)


# -- a replay ----------------------------------------------------------------------------------------------
def cpu_only_first_fit(nodes: list[Node], task: Task) -> Node | None:
    for node in nodes:
        if host_fits(node, task):
            return node
    return None


def request_for(job_id: int, task: Task):
    from scheduler import placement

    shared = 0 < task.milli < 1000
    return placement.Request(
        job_id=job_id,
        tenant="t",
        rank=0,
        submitted_ms=job_id,
        shared=shared,
        count=1 if shared else task.count,
        share_milli=task.milli if shared else 1000,
        gpu_model="|".join(task.models),
        cpu_milli=task.cpu,
        memory_mib=task.memory,
    )


def replay(policy: str, node_rows: list[tuple], arrived: list[Task], classes: list[tuple], cpu_only: str) -> Outcome:
    """``cpu_only``: "own" (the policy places CPU-only tasks itself) or "first-fit" (every policy alike)."""
    from scheduler import placement

    nodes = [
        Node(i, n, cpu, mem, model, [0] * count, [False] * count)
        for i, (n, cpu, mem, count, model) in enumerate(node_rows)
    ]
    by_name = {n.name: n for n in nodes}
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    session = fgd = None
    if policy == "gpushare":
        slots = [
            placement.NodeSlot(
                name=n.name,
                cpu_milli=n.cpu,
                memory_mib=n.memory,
                gpus=[
                    placement.GpuSlot(
                        uuid=f"{n.name}/{i}", node=n.name, model=n.model, memory_mb=GPU_MEMORY.get(n.model, 16384)
                    )
                    for i in range(len(n.gpus))
                ],
            )
            for n in nodes
        ]
        session = placement.Session(slots, policy=placement.Policy(now_ms=0))
    elif policy == "fgd":
        fgd = FGD(nodes, classes)
    outcome = Outcome(policy)
    allocated = 0
    seconds = core_cpu = 0.0
    loop_started = time.perf_counter()
    cpu_started = time.process_time()
    for job_id, task in enumerate(arrived, 1):
        if task.count == 0 and cpu_only == "first-fit":
            host = cpu_only_first_fit(nodes, task)
            if host is not None:
                apply(host, [], task)
                if session is not None:  # the core keeps its own host accounting
                    session.host_taken(host.name, task.cpu, task.memory)
                if fgd is not None:
                    fgd.moved(host)
            continue
        if session is not None:
            request = request_for(job_id, task)
            started, started_cpu = time.perf_counter(), time.thread_time()
            decided = session.offer(request)
            core_cpu += time.thread_time() - started_cpu
            seconds += time.perf_counter() - started
            found = None
            if decided is not None:
                node = by_name[decided.node]
                found = (node, [int(uuid.rsplit("/", 1)[1]) for uuid in decided.gpu_uuids])
        elif fgd is not None:
            found = fgd.place(task)
        else:
            found = baseline_place(nodes, task, best=policy == "best-fit")
        outcome.decisions += 1
        if found is None:
            outcome.failed += 1
            kind = (task.count, "cpu" if not task.count else "share" if task.milli < 1000 else "whole")
            outcome.failed_demand[kind] = outcome.failed_demand.get(kind, 0) + task.count * task.milli
            continue
        node, gpus = found
        assert len(gpus) == task.count, (policy, task, gpus)
        apply(node, gpus, task)
        assert node.cpu_used <= node.cpu and node.memory_used <= node.memory, "host resources exceeded"
        if fgd is not None:
            fgd.moved(node)
        allocated += task.count * task.milli
    outcome.seconds = seconds if session is not None else time.perf_counter() - loop_started
    outcome.cpu_seconds = time.process_time() - cpu_started
    outcome.core_cpu_seconds = core_cpu if session is not None else outcome.cpu_seconds
    outcome.allocated_pct = 100 * allocated / capacity
    outcome.mixed_gpus = sum(
        1 for n in nodes for used, whole in zip(n.gpus, n.whole, strict=True) if (whole and used != 1000) or used > 1000
    )
    if session is not None:  # the core's own view must agree: no GPU both whole and sliced, none over-full
        for slot in session._planner.fleet.gpus.values():
            if slot.used_milli > 1000 or (slot.dedicated and len(slot.holders) != 1):
                outcome.mixed_gpus += 1
    return outcome


def sweep(variants, shares_modes=("exact", "slices"), seeds=3, cpu_only_modes=("own", "first-fit"), log=None) -> dict:
    results: dict[tuple, list[Outcome]] = {}
    for variant in variants:
        pod_file, node_file = VARIANTS[variant]
        node_rows = load_nodes(node_file)
        capacity = sum(row[3] for row in node_rows)
        raw = load_tasks(pod_file)
        for shares in shares_modes:
            tasks = [rounded(t) for t in raw] if shares == "slices" else raw
            classes = task_classes(tasks)
            for cpu_only in cpu_only_modes:
                for s in range(seeds):
                    arrived = draw(tasks, capacity, SEED + s)
                    for policy in POLICIES:
                        outcome = replay(policy, node_rows, arrived, classes, cpu_only)
                        results.setdefault((variant, shares, cpu_only, policy), []).append(outcome)
                if log:
                    log(variant, shares, cpu_only, {p: results[(variant, shares, cpu_only, p)] for p in POLICIES})
    return results


def summarize(results: dict) -> dict:
    out = {}
    for key, outcomes in results.items():
        out[key] = {
            "allocated_pct": sum(o.allocated_pct for o in outcomes) / len(outcomes),
            "decisions_per_s": sum(o.decisions for o in outcomes) / max(1e-9, sum(o.seconds for o in outcomes)),
            "decisions_per_cpu_s": sum(o.decisions for o in outcomes) / max(1e-9, sum(o.cpu_seconds for o in outcomes)),
            "core_decisions_per_cpu_s": sum(o.decisions for o in outcomes)
            / max(1e-9, sum(o.core_cpu_seconds for o in outcomes)),
            "failed": sum(o.failed for o in outcomes) / len(outcomes),
            "mixed_gpus": sum(o.mixed_gpus for o in outcomes),
            "runs": len(outcomes),
        }
    return out


def line(variant: str, shares: str, cpu_only: str, summary: dict) -> str:
    s = {p: summary[(variant, shares, cpu_only, p)] for p in POLICIES}
    best_other = max(s[p]["allocated_pct"] for p in POLICIES[1:])
    ours = s["gpushare"]["allocated_pct"]
    g = s["gpushare"]
    return (
        f"{variant:<12} {shares:<6} cpu-only:{cpu_only:<9} "
        + " ".join(f"{p} {s[p]['allocated_pct']:6.2f}" for p in POLICIES)
        + f"  {'>=' if ours >= best_other - 1e-9 else 'BEHIND'} best {best_other:6.2f}"
        + f"  core {g['core_decisions_per_cpu_s']:,.0f} per CPU-s ({g['decisions_per_s']:,.0f}/s wall)"
        + f", replay {g['decisions_per_cpu_s']:,.0f} per CPU-s"
        + f" (fgd {s['fgd']['decisions_per_s']:,.0f})"
        + f"  mixed {s['gpushare']['mixed_gpus']}"
    )


def core_build() -> str:
    """Which core made the decisions: compiled (mypyc) or plain Python, and why (see scheduler/placement/native.py)."""
    from scheduler.placement import native

    return "core compiled (mypyc)" if native.compiled() else f"core plain Python ({native.reason})"


def run(quick: bool = False) -> dict:
    """For ``python -m bench``: the sweep as rows (quick: four variants, one seed, CPU-only tasks placed by
    each policy)."""
    variants = QUICK_VARIANTS if quick else tuple(VARIANTS)
    results = sweep(variants, seeds=1 if quick else 3, cpu_only_modes=("own",) if quick else ("own", "first-fit"))
    summary = summarize(results)
    rows = []
    for variant, shares, cpu_only, policy in summary:
        if policy != "gpushare":
            continue
        ours = summary[(variant, shares, cpu_only, "gpushare")]
        for baseline in POLICIES[1:]:
            ref = summary[(variant, shares, cpu_only, baseline)]
            rows.append(
                {
                    "bench": "packing",
                    "metric": f"GPUs allocated at 100% arrived demand, {variant}, {shares} shares, "
                    f"CPU-only tasks {'by each policy' if cpu_only == 'own' else 'first-fit'}",
                    "ours": round(ours["allocated_pct"], 2),
                    "unit": "%",
                    "reference": round(ref["allocated_pct"], 2),
                    "reference_name": baseline,
                    "goal": f">= {baseline}",
                    "goal_met": ours["allocated_pct"] >= ref["allocated_pct"],
                    "runs": ours["runs"],
                    "note": "",
                }
            )
        rows.append(
            {
                "bench": "packing",
                "metric": f"core decisions per CPU-s in the replay, {variant}, {shares} shares, CPU-only {cpu_only}",
                "ours": round(ours["core_decisions_per_cpu_s"]),
                "unit": "decisions/CPU-s",
                "goal": ">= 20000",
                "goal_met": ours["core_decisions_per_cpu_s"] >= 20000,
                "runs": ours["runs"],
                "note": f"{core_build()}; wall inside the core {ours['decisions_per_s']:,.0f}/s (shared machine);"
                f" GPUs both whole and sliced: {ours['mixed_gpus']}",
            }
        )
    return {"rows": rows, "summary": {"/".join(k): v for k, v in summary.items()}}


def main(argv: list[str]) -> None:
    import argparse

    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(prog="python -m bench.packing_alibaba")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--shares", action="append", choices=("exact", "slices"))
    parser.add_argument("--cpu-only", action="append", choices=("own", "first-fit"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="four variants, one seed, CPU-only tasks by each policy")
    args = parser.parse_args(argv)
    if args.quick:
        variants, seeds, cpu_only = QUICK_VARIANTS, 1, ("own",)
    else:
        variants, seeds, cpu_only = (
            tuple(args.variant or VARIANTS),
            args.seeds,
            tuple(args.cpu_only or ("own", "first-fit")),
        )
    started = time.perf_counter()

    def log(variant, shares, mode, outcomes):
        print(
            line(variant, shares, mode, summarize({(variant, shares, mode, p): o for p, o in outcomes.items()})),
            flush=True,
        )

    results = sweep(variants, tuple(args.shares or ("exact", "slices")), seeds, cpu_only, log=log)
    summary = summarize(results)
    behind = [
        k
        for k in summary
        if k[3] == "gpushare"
        and any(summary[k]["allocated_pct"] < summary[(*k[:3], p)]["allocated_pct"] - 1e-9 for p in POLICIES[1:])
    ]
    print(
        f"{len(summary) // len(POLICIES)} rows, gpushare behind the best baseline on {len(behind)}; "
        f"{time.perf_counter() - started:.0f} s, {seeds} seed(s); {core_build()}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
