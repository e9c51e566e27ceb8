"""Profile the API's hot paths in one process: ``python -m bench.profile_paths``.

Where the time of a submit, a job list page and a job detail goes, with
pyinstrument (requirements-dev.txt), through the whole Django stack
(middleware, DRF, authentication, throttle, serializers) on the database and
Redis named by DATABASE_URL / REDIS_URL (a scratch database: it is migrated,
and a tenant ``profile`` with queued and finished jobs is created in it).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpushare_scratch REDIS_URL=redis://127.0.0.1:6379/6 \\
        python -m bench.profile_paths --n 300 --history 20000 [--html var/profile]

Prints, per path, the mean wall time per request and pyinstrument's tree.
docs/benchmarks.md quotes its output before and after the submit work.

``--idle S``: no profiler; each request after ``S`` seconds of idle (as the
vs-slurm array row measures its call) and again right after, the median wall
of each and the part of it spent in SQL statements (their round trips; the
COMMIT is psycopg2's and counts as the rest). On this VM an idle second makes
the next request's every first touch slow (docs/benchmarks.md, sessions 16-17).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_paths")
    parser.add_argument("--n", type=int, default=300, help="requests per path")
    parser.add_argument("--history", type=int, default=20_000, help="finished jobs inserted first")
    parser.add_argument("--queued", type=int, default=2_000, help="queued jobs inserted first")
    parser.add_argument(
        "--paths", default="submit,list,detail", help="comma-separated: bare, trivial, submit, list, detail, array"
    )
    parser.add_argument("--html", help="also write pyinstrument HTML reports to this folder")
    parser.add_argument(
        "--cpu", action="store_true", help="no profiler: CPU ms per request (this process), best of 5 batches"
    )
    parser.add_argument(
        "--idle", type=float, help="no profiler: each request after this many seconds idle, and right after"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    os.environ.setdefault("GPUSHARE_API_RATE", "100000/s")
    os.environ.setdefault("GPUSHARE_TENANT_API_RATE", "100000/s")
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        print("set DATABASE_URL to a scratch PostgreSQL database", file=sys.stderr)
        return 2
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django_scopes import scopes_disabled
    from pyinstrument import Profiler

    from accounts.models import Membership, Tenant, TenantQuota
    from accounts.services import ALL_SCOPES, tenant_create, token_create
    from agents.models import Gpu, Node
    from console.management.commands.seed_demo import prices_ensure, priority_classes_ensure
    from scheduler.counts import counts_fold

    from .fixtures import finished_jobs_create

    settings.ALLOWED_HOSTS = ["*"]
    settings.ROOT_URLCONF = "bench.urls"  # gpushare's, and the bare view the api benchmark measures against
    call_command("migrate", "--noinput", verbosity=0)
    with scopes_disabled():
        priority_classes_ensure()
        prices_ensure()
        tenant = Tenant.objects.filter(slug="profile").first() or tenant_create(
            slug="profile", name="Profile", owner_email="profile@bench.test", owner_password=None
        )
        user = Membership.objects.filter(tenant=tenant).first().user
        # Arrays of 1,000 one after another: no open-job limit in the way (their tasks are never run here).
        TenantQuota.objects.update_or_create(tenant=tenant, defaults={"max_open_jobs": 10**9, "max_queued_jobs": 10**9})
        token = token_create(tenant=tenant, user=user, name="profile", scopes=ALL_SCOPES).plaintext
        node, _ = Node.objects.get_or_create(name="profile-node", defaults={"state": "cordoned"})
        for i in range(2):
            Gpu.objects.get_or_create(
                node=node, index=i, defaults={"uuid": f"GPU-profile-{i}", "model": "H100-80GB", "memory_mb": 81559}
            )
    if args.history:
        finished_jobs_create(tenant_id=tenant.pk, node_name="profile-node", count=args.history)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"kind": "inference", "gpus": 0.125, "command": ["true"]}
    for _ in range(args.queued):
        client.post("/api/v1/jobs/", body, content_type="application/json")
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE scheduler_job")
    job_id = client.get("/api/v1/jobs/?page_size=1").json()["results"][0]["id"]
    paths = {
        "submit": lambda: client.post("/api/v1/jobs/", body, content_type="application/json"),
        "bare": lambda: client.get("/bench/bare/"),
        "trivial": lambda: client.get("/api/v1/"),
        "list": lambda: client.get("/api/v1/jobs/"),
        "detail": lambda: client.get(f"/api/v1/jobs/{job_id}/"),
        "array": lambda: client.post(
            "/api/v1/jobs/", {**body, "array": {"count": 1000}}, content_type="application/json"
        ),
    }
    for name in args.paths.split(","):
        call = paths[name]
        for _ in range(10):
            call()  # warm up: imports, connections, caches
        n = max(1, args.n // 50) if name == "array" else args.n
        if args.idle:
            idle_report(name, call, n=min(n, 30), idle_s=args.idle, fold=counts_fold)
            continue
        if args.cpu:
            batches, walls = [], []
            for _ in range(5):
                counts_fold()  # what the scheduling pass does (no worker here): changes since the last batch
                started, wall = time.process_time(), time.perf_counter()
                for _ in range(n):
                    call()
                batches.append((time.process_time() - started) / n * 1000)
                walls.append((time.perf_counter() - wall) / n * 1000)
            print(
                f"{name}: {min(batches):.3f} ms CPU per request (best of 5 x {n}; median {sorted(batches)[2]:.3f}), "
                f"wall {min(walls):.3f} (median {sorted(walls)[2]:.3f}): the rest is waiting on PostgreSQL and Redis"
            )
            continue
        profiler = Profiler(interval=0.0005)
        start = time.perf_counter()
        with profiler:
            for _ in range(n):
                response = call()
                if response.status_code >= 300:
                    print(f"{name}: {response.status_code} {response.content[:300]!r}", file=sys.stderr)
                    return 1
        elapsed = time.perf_counter() - start
        print(f"\n=== {name}: {n} requests, {elapsed / n * 1000:.2f} ms each ===")
        every_frame = bool(os.environ.get("PROFILE_ALL"))
        print(profiler.output_text(unicode=False, color=False, show_all=every_frame, short_mode=not every_frame))
        if args.html:
            Path(args.html).mkdir(parents=True, exist_ok=True)
            (Path(args.html) / f"{name}.html").write_text(profiler.output_html())
    return 0


def idle_report(name: str, call, *, n: int, idle_s: float, fold) -> None:
    """``n`` calls each after ``idle_s`` idle, each followed by one right after: median wall and SQL time."""
    from statistics import median

    from django.db import connection

    spent: list[float] = []

    def timed(execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent.append(time.perf_counter() - started)

    rows: dict[str, list[tuple[float, float]]] = {"after idle": [], "right after": []}
    for _ in range(n):
        fold()
        for label, pause in (("after idle", idle_s), ("right after", 0.0)):
            time.sleep(pause)
            spent.clear()
            with connection.execute_wrapper(timed):
                started = time.perf_counter()
                call()
                wall = time.perf_counter() - started
            rows[label].append((wall, sum(spent)))
    for label, values in rows.items():
        wall, sql = median(w for w, _ in values) * 1000, median(s for _, s in values) * 1000
        print(f"{name}, {label} (median of {n}): {wall:.2f} ms wall, {sql:.2f} in SQL, {wall - sql:.2f} the rest")


if __name__ == "__main__":
    sys.exit(main())
