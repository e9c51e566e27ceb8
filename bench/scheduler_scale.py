"""Scheduler at fleet scale: one full pass over a 10,000-job backlog.

    python -m bench.scheduler_scale [--quick]

Measures, on this machine:

- the full pass as production runs it (``scheduler.services.schedule_pass``):
  read the queue and the fleet from PostgreSQL, decide, write allocations,
  states, events and pending reasons in one transaction, and send the launch
  messages to the nodes' Redis queues after commit; goal >= 2,000 placements/s;
- the pure core alone (``scheduler.placement.plan``) on the same data;
  goal >= 20,000 decisions/s (a decision is a job placed or given its reason);
- both at 100, 1,000 and 5,000 nodes of 8 GPUs.

The backlog: 70% shared slices (1/8, 1/4, 1/2), 30% dedicated 1-8 GPUs, three
priority classes, 20 tenants with weights, some model constraints; the fleet is
75% H100 and 25% L4 nodes, empty at the start. The database part runs in a
child process on its own database (``BENCH_SCHED_DATABASE_URL``, default
``gpushare_bench_sched``, dropped and recreated) so it never touches another one,
and its own Redis db (``BENCH_SCHED_REDIS_URL``, default db 13; only the bench
nodes' queues are deleted). The nodes' queues are declared before the timed
pass, as running agents and a long-lived worker have them.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
DATABASE_URL = os.environ.get("BENCH_SCHED_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare_bench_sched")
REDIS_URL = os.environ.get("BENCH_SCHED_REDIS_URL", "redis://127.0.0.1:6379/13")
SEED = 20260
CLASSES = {"serving": 300, "standard": 200, "preemptible": 100}
MODELS = [("H100-80GB", 81920), ("L4-24GB", 24576)]
SIZES = (100, 1000, 5000)
GPUS_PER_NODE = 8


# -- workload (plain data, shared by the core and the database runs) ---------------------------------------------
def workload(jobs: int, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(jobs):
        shared = rng.random() < 0.7
        if shared:
            milli = rng.choice([125, 250, 500])
            klass = "serving" if rng.random() < 0.7 else "preemptible"
        else:
            milli = 1000 * rng.choices([1, 2, 3, 4, 5, 6, 7, 8], weights=[40, 20, 3, 20, 1, 1, 0.5, 15])[0]
            klass = "standard" if rng.random() < 0.7 else "preemptible"
        model = rng.choice(["H100-80GB", "L4-24GB"]) if rng.random() < 0.2 else ""
        out.append(
            {
                "i": i,
                "tenant": f"t{rng.randrange(20):02d}",
                "class": klass,
                "shared": bool(shared),
                "milli": milli,
                "model": model,
                "runtime_s": rng.choice([600, 3600, 4 * 3600, 24 * 3600]),
                "submitted_ms": i,
            }
        )
    return out


def fleet_spec(nodes: int) -> list[tuple[str, str, int]]:
    return [(f"bench-{n:05d}", *MODELS[0 if n % 4 else 1]) for n in range(nodes)]


def tenant_weights() -> dict[str, float]:
    rng = random.Random(SEED + 1)
    return {f"t{t:02d}": rng.choice([1, 1, 2, 3, 5]) for t in range(20)}


# -- the pure core ------------------------------------------------------------------------------------------
def core_run(nodes: int, jobs: list[dict]) -> dict:
    from scheduler import placement

    fleet = [
        placement.NodeSlot(
            name=name,
            gpus=[
                placement.GpuSlot(uuid=f"{name}-{i}", node=name, model=model, memory_mb=memory)
                for i in range(GPUS_PER_NODE)
            ],
        )
        for name, model, memory in fleet_spec(nodes)
    ]
    requests = [
        placement.Request(
            job_id=j["i"] + 1,
            tenant=j["tenant"],
            rank=CLASSES[j["class"]],
            submitted_ms=j["submitted_ms"],
            shared=j["shared"],
            count=1 if j["shared"] else j["milli"] // 1000,
            share_milli=j["milli"] if j["shared"] else 1000,
            gpu_model=j["model"],
            max_runtime_ms=j["runtime_s"] * 1000,
            priority=j["class"],
        )
        for j in jobs
    ]
    policy = placement.Policy(
        now_ms=10**12,
        weights=tenant_weights(),
        may_preempt={"serving": frozenset({"preemptible"}), "standard": frozenset({"preemptible"})},
    )
    best = None
    for _ in range(3):
        nodes_copy = copy.deepcopy(fleet)
        started = time.perf_counter()
        result = placement.plan(nodes_copy, requests, policy=policy)
        elapsed = time.perf_counter() - started
        best = min(best or elapsed, elapsed)
    placed_milli = sum(p.share_milli * len(p.gpu_uuids) for p in result.placements)
    return {
        "nodes": nodes,
        "jobs": len(requests),
        "placed": len(result.placements),
        "pending": len(result.pending),
        "seconds": best,
        "decisions_per_s": len(requests) / best,
        "gpus_allocated_pct": 100 * placed_milli / (nodes * GPUS_PER_NODE * 1000),
    }


# -- the database pass (child process) ----------------------------------------------------------------------
def database_recreate(url: str) -> None:
    import psycopg2

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    if "bench" not in name:
        raise RuntimeError(f"refusing to drop database {name!r}: its name must contain 'bench'")
    conn = psycopg2.connect(
        host=parsed.hostname or "127.0.0.1",
        port=parsed.port or 5432,
        user=parsed.username or "postgres",
        password=parsed.password,
        dbname="postgres",
    )
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()


def _child_setup() -> None:
    os.environ.update(
        DJANGO_SETTINGS_MODULE="gpushare.settings.test",
        DATABASE_URL=DATABASE_URL,
        REDIS_URL=REDIS_URL,
        LOG_LEVEL="WARNING",
    )
    database_recreate(DATABASE_URL)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    from console.management.commands.seed_demo import priority_classes_ensure

    priority_classes_ensure()


def _db_load(nodes: int, jobs: list[dict]) -> None:
    from django.db import connection
    from django.utils import timezone
    from django_scopes import scopes_disabled

    from accounts.models import Tenant
    from agents.models import Gpu, Node
    from scheduler.models import Job, JobMode, PriorityClass, TenantShare

    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE scheduler_allocation, scheduler_jobevent, scheduler_tenantusage, scheduler_job, "
            "agents_gpu, agents_node CASCADE"
        )
    with scopes_disabled():
        tenants = {t.slug: t for t in Tenant.objects.all()}
        for slug, weight in tenant_weights().items():
            if slug not in tenants:
                tenants[slug] = Tenant.objects.create(slug=slug, name=slug)
                TenantShare.objects.create(tenant=tenants[slug], weight=weight)
        now = timezone.now()
        node_rows = Node.objects.bulk_create(
            Node(name=name, state=Node.State.UP, token_hash="x", registered_at=now, last_heartbeat_at=now)
            for name, _, _ in fleet_spec(nodes)
        )
        Gpu.objects.bulk_create(
            (
                Gpu(node=node, uuid=f"GPU-{node.name}-{i}", index=i, model=model, memory_mb=memory)
                for node, (_, model, memory) in zip(node_rows, fleet_spec(nodes), strict=True)
                for i in range(GPUS_PER_NODE)
            ),
            batch_size=5000,
        )
        classes = {c.name: c for c in PriorityClass.objects.all()}
        base = timezone.now()
        from datetime import timedelta

        Job.objects.bulk_create(
            (
                Job(
                    tenant=tenants[j["tenant"]],
                    name=f"bench-{j['i']}",
                    kind="inference" if j["shared"] else "training",
                    mode=JobMode.SHARED if j["shared"] else JobMode.DEDICATED,
                    gpu_milli=j["milli"],
                    command=["python", "-c", "pass"],
                    gpu_model=j["model"],
                    priority=classes[j["class"]],
                    max_runtime_s=j["runtime_s"],
                    pending_reason="waiting for the next scheduling pass",
                    submitted_at=base + timedelta(milliseconds=j["i"]),
                )
                for j in jobs
            ),
            batch_size=2000,
        )
    with connection.cursor() as cur:
        cur.execute("ANALYZE")


def _queues_clear(nodes: int) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    names = [f"node.{name}" for name, _, _ in fleet_spec(nodes)]
    for i in range(0, len(names), 1000):
        client.delete(*names[i : i + 1000])


def _queued_messages(nodes: int) -> int:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    pipe = client.pipeline()
    for name, _, _ in fleet_spec(nodes):
        pipe.llen(f"node.{name}")
    return sum(pipe.execute())


def _queues_declare(nodes: int) -> None:
    """What running agents and a warm worker have done already: each node's queue is declared once."""
    from kombu.common import maybe_declare

    from agents.agent.brokerconf import node_queue
    from gpushare.celery import app

    with app.producer_or_acquire() as producer:
        for name, _, _ in fleet_spec(nodes):
            maybe_declare(app.amqp.queues[node_queue(name)], producer.channel)


def child_main(quick: bool) -> dict:
    _child_setup()
    from scheduler.services import schedule_pass

    jobs = workload(2000 if quick else 10_000)
    out = {"passes": []}
    for nodes in SIZES[:2] if quick else SIZES:
        _db_load(nodes, jobs)
        _queues_clear(nodes)
        _queues_declare(nodes)
        started = time.perf_counter()
        result = schedule_pass()
        elapsed = time.perf_counter() - started
        sent = _queued_messages(nodes)
        second_started = time.perf_counter()
        again = schedule_pass()  # the steady state: nothing fits any more, every reason is already written
        second = time.perf_counter() - second_started
        _queues_clear(nodes)
        out["passes"].append(
            {
                "nodes": nodes,
                "jobs": len(jobs),
                "placed": result.placed,
                "pending": result.pending,
                "seconds": elapsed,
                "placements_per_s": result.placed / elapsed,
                "launch_messages": sent,
                "second_pass_seconds": second,
                "second_pass_placed": again.placed,
                "phases": {**result.timings, "commit_and_dispatch": elapsed - result.seconds},
            }
        )
    return out


# -- entry points ---------------------------------------------------------------------------------------------
def run(quick: bool = False) -> dict:
    jobs = workload(2000 if quick else 10_000)
    core = [core_run(nodes, jobs) for nodes in (SIZES[:2] if quick else SIZES)]
    child = subprocess.run(
        [sys.executable, "-m", "bench.scheduler_scale", "--child", *(["--quick"] if quick else [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"database pass failed: {child.stderr[-3000:]}")
    passes = json.loads(child.stdout.strip().splitlines()[-1])["passes"]
    rows = []
    for c in core:
        rows.append(
            {
                "bench": "scheduler-scale",
                "metric": f"core decisions/s, {c['nodes']} nodes x 8, {c['jobs']} jobs",
                "ours": round(c["decisions_per_s"]),
                "unit": "decisions/s",
                "goal": ">= 20000",
                "goal_met": c["decisions_per_s"] >= 20_000,
                "note": f"{c['placed']} placed, {c['pending']} pending, {c['gpus_allocated_pct']:.1f}% GPUs allocated",
            }
        )
    for p in passes:
        rows.append(
            {
                "bench": "scheduler-scale",
                "metric": f"full pass placements/s, {p['nodes']} nodes x 8, {p['jobs']} jobs",
                "ours": round(p["placements_per_s"]),
                "unit": "placements/s",
                "goal": ">= 2000",
                "goal_met": p["placements_per_s"] >= 2000,
                "note": f"{p['placed']} placed in {p['seconds']:.2f} s (PostgreSQL read+write, {p['launch_messages']} "
                f"launches sent); next pass {p['second_pass_seconds']:.2f} s",
            }
        )
    return {"rows": rows, "core": core, "passes": passes}


def main() -> None:
    quick = "--quick" in sys.argv
    if "--child" in sys.argv:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(child_main(quick)))
        return
    result = run(quick=quick)
    for row in result["rows"]:
        print(
            f"{row['metric']:<60} {row['ours']:>10} {row['unit']:<13} goal {row['goal']:<9} "
            f"{'met' if row['goal_met'] else 'MISSED'}  {row['note']}"
        )


if __name__ == "__main__":
    main()
