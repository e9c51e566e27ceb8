"""Time the what-if replay on a synthetic day: `manage.py whatif_bench --jobs 1000 --nodes 10`."""

from __future__ import annotations

import random
import time

from django.core.management.base import BaseCommand

from console import whatif
from scheduler import placement

MIN = 60_000


def synthetic_fleet(nodes: int) -> list[placement.NodeSlot]:
    fleet = []
    for n in range(nodes):
        node = placement.NodeSlot(name=f"n{n}")
        node.gpus = [
            placement.GpuSlot(uuid=f"g{n}-{i}", node=f"n{n}", model="H100-80GB", memory_mb=81920) for i in range(8)
        ]
        fleet.append(node)
    return fleet


def synthetic_day(jobs: int, seed: int) -> list[whatif.HistoryJob]:
    """70% slices (1/8, 1/4, 1/2), 30% dedicated (1, 2, 4 or 8 GPUs); 5 min to 4 h; 20 tenants; 3 classes."""
    rnd = random.Random(seed)
    history = []
    for i in range(jobs):
        shared = rnd.random() < 0.7
        history.append(
            whatif.HistoryJob(
                job_id=i,
                tenant=f"t{rnd.randrange(20)}",
                priority=rnd.choice(["serving", "standard", "preemptible"]),
                submitted_ms=rnd.randrange(24 * 60) * MIN,
                run_ms=rnd.randrange(5, 240) * MIN,
                shared=shared,
                count=1 if shared else rnd.choice([1, 1, 2, 4, 8]),
                share_milli=rnd.choice([125, 250, 500]) if shared else 1000,
                max_runtime_ms=4 * 60 * MIN,
            )
        )
    return history


RULES = whatif.Rules(
    classes={
        "serving": whatif.ClassRule("serving", 300, may_preempt=frozenset({"preemptible"})),
        "standard": whatif.ClassRule("standard", 200, may_preempt=frozenset({"preemptible"})),
        "preemptible": whatif.ClassRule("preemptible", 100, preemptible=True, min_runtime_ms=60_000),
    }
)


class Command(BaseCommand):
    help = "Time one what-if replay (one rule set) of a synthetic day of submissions."

    def add_arguments(self, parser):
        parser.add_argument("--jobs", type=int, default=1000)
        parser.add_argument("--nodes", type=int, default=10)
        parser.add_argument("--seed", type=int, default=7)

    def handle(self, *args, jobs, nodes, seed, **options):
        history, fleet = synthetic_day(jobs, seed), synthetic_fleet(nodes)
        started = time.perf_counter()
        replay = whatif.simulate(history=history, nodes=fleet, rules=RULES)
        seconds = time.perf_counter() - started
        preemptions = sum(o.preemptions for o in replay.outcomes.values())
        self.stdout.write(
            f"{jobs} submissions on {nodes} nodes x 8 GPUs: {seconds:.2f} s, {replay.passes} passes, "
            f"utilisation {replay.utilisation:.2f}, {preemptions} preemptions"
        )
