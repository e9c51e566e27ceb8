"""The fault-injection cases. Each starts a fresh platform stack (bench.stack)
on its own database, injects one fault, and checks what must still hold.

A case returns a CaseResult: passed or not, with the figures it measured.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import psutil

from agents.agent.brokerconf import REPORT_QUEUE
from bench.stack import DEFAULT_REDIS_URL, Stack, StackConfig

CHAOS_DATABASE_URL = os.environ.get("CHAOS_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare_chaos")
CHAOS_REDIS_URL = os.environ.get("CHAOS_REDIS_URL", DEFAULT_REDIS_URL)


@dataclass
class CaseResult:
    name: str
    passed: bool
    figures: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    error: str = ""


class Checks:
    """Named boolean checks; the case passes when all hold."""

    def __init__(self):
        self.results: dict[str, bool] = {}

    def __call__(self, name: str, ok: bool) -> bool:
        self.results[name] = bool(ok)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(self.results.values())


def stack_start(
    ctx,
    name: str,
    *,
    gpus: str = "sim:4xH100-80GB",
    env: dict | None = None,
    agent: bool = True,
    agent_kwargs: dict | None = None,
    redis_url: str = CHAOS_REDIS_URL,
) -> Stack:
    from django.db import connections

    connections.close_all()  # the database is about to be dropped and created again
    config = StackConfig(database_url=CHAOS_DATABASE_URL, redis_url=redis_url, gpus=gpus, extra_env=dict(env or {}))
    stack = Stack(ctx.workdir / name, config)
    ctx.stacks.append(stack)
    stack.prepare()
    from scheduler.models import PriorityClass

    PriorityClass.objects.update(grace_period_s=2)  # cancelled jobs get 2 s before SIGKILL
    stack.worker_start()
    stack.web_start()
    if agent:
        stack.agent_start(**(agent_kwargs or {}))
    return stack


def submit(stack, body: dict, session=None) -> int:
    s = session or stack.session()
    r = s.post(f"{stack.url}/api/v1/jobs/", json=body, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")
    return r.json()["id"]


def sleep_job(marker: int, gpus=1) -> dict:
    kind = "training" if gpus >= 1 else "inference"
    return {"kind": kind, "gpus": gpus, "command": ["sleep", str(marker)]}


def states(ids) -> dict[int, str]:
    from django_scopes import scopes_disabled

    from scheduler.models import Job

    with scopes_disabled():
        return dict(Job.objects.filter(pk__in=ids).values_list("pk", "state"))


def wait_states(stack, ids, wanted: set[str], timeout: float, what: str) -> float:
    start = time.monotonic()
    stack.wait(lambda: all(s in wanted for s in states(ids).values()), timeout, what)
    return time.monotonic() - start


TERMINAL = {"succeeded", "failed", "cancelled", "lost"}


def eventually(stack, predicate, timeout: float, what: str) -> bool:
    """Like stack.wait, but answers False instead of raising when time runs out."""
    try:
        stack.wait(predicate, timeout, what)
    except Exception:  # noqa: BLE001 - the caller records the failed check
        return False
    return True


def cancel_all(stack, ids) -> None:
    s = stack.session()
    for job_id in ids:
        s.post(f"{stack.url}/api/v1/jobs/{job_id}/cancel/", timeout=30)


def marker_processes(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and "python" not in cmd:
            out.append(p)
    return out


def windows_of(job_ids) -> list[tuple]:
    from django_scopes import scopes_disabled

    from billing.models import UsageWindow

    with scopes_disabled():
        return list(
            UsageWindow.objects.filter(job_id__in=job_ids)
            .order_by("job_id", "attempt", "seq")
            .values_list("job_id", "attempt", "seq", "start_ms", "end_ms", "amount")
        )


def costs_consistent(job_ids) -> bool:
    """Each job's running total equals the sum of its stored windows (nothing charged twice)."""
    from decimal import Decimal

    from django_scopes import scopes_disabled

    from scheduler.models import Job

    sums: dict[int, Decimal] = {}
    for job_id, _a, _s, _st, _e, amount in windows_of(job_ids):
        sums[job_id] = sums.get(job_id, Decimal(0)) + amount
    with scopes_disabled():
        return all(job.cost == sums.get(job.pk, Decimal(0)) for job in Job.objects.filter(pk__in=job_ids))


def gpu_sharing_ok() -> tuple[bool, int]:
    """No GPU over-committed: live shares <= 1000 thousandths, never dedicated and sliced at once."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT gpu_id, SUM(share_milli), COUNT(*) FILTER (WHERE share_milli = 1000), COUNT(*) "
            "FROM scheduler_allocation WHERE released_at IS NULL GROUP BY gpu_id"
        )
        rows = cur.fetchall()
    bad = [r for r in rows if r[1] > 1000 or (r[2] and r[3] > 1)]
    return not bad, len(rows)


# --- the cases -----------------------------------------------------------------


def agent_kill9(ctx) -> CaseResult:
    """kill -9 the agent while jobs run: lost within the heartbeat timeout, GPUs freed,
    billing stops at the last window, and a restarted agent reconciles."""
    hb, missed, check_every = 1, 3, 5
    stack = stack_start(
        ctx,
        "agent-kill9",
        env={"GPUSHARE_HEARTBEAT_INTERVAL_S": str(hb), "GPUSHARE_MISSED_HEARTBEATS_DOWN": str(missed)},
    )
    from django_scopes import scopes_disabled

    from scheduler.models import Allocation, JobEvent

    c, f = Checks(), {}
    marker = 6007
    ids = [submit(stack, sleep_job(marker)) for _ in range(4)]
    wait_states(stack, ids, {"running"}, 60, "4 jobs running")
    time.sleep(3)
    agent = stack.procs["agent"]
    kill_ms = int(time.time() * 1000)
    os.kill(agent.proc.pid, signal.SIGKILL)  # the agent process only, as a crash: its jobs live on
    agent.proc.wait(timeout=10)
    bound = hb * missed + check_every + 5
    with scopes_disabled():

        def all_lost():
            return JobEvent.objects.filter(job_id__in=ids, to_state="lost").values("job_id").distinct().count() == 4

        eventually(stack, all_lost, bound + 30, "jobs marked lost")
        f["lost_after_s"] = (time.time() * 1000 - kill_ms) / 1000
        c("jobs lost within the heartbeat timeout", all_lost() and f["lost_after_s"] <= bound)
        f["bound_s"] = bound
        c("GPUs freed", Allocation.objects.filter(job_id__in=ids, released_at__isnull=True).count() == 0)
    time.sleep(2)
    last_end = max((w[4] for w in windows_of(ids) if w[1] == 1), default=0)
    f["billed_after_kill_ms"] = last_end - kill_ms
    c("billing stops at the last window", last_end <= kill_ms + 2000)
    f["orphans_before_restart"] = len(marker_processes(f"sleep {marker}"))
    stack.agent_start(name="agent-restarted")
    try:
        wait_states(stack, ids, {"running"}, 60, "requeued jobs running again")
        c("requeued jobs run again after restart", True)
    except Exception:  # noqa: BLE001
        c("requeued jobs run again after restart", False)
    time.sleep(1)
    f["job_processes_after_restart"] = len(marker_processes(f"sleep {marker}"))
    c("restart killed the orphans (one process per job)", f["job_processes_after_restart"] == 4)
    last_end_after = max((w[4] for w in windows_of(ids) if w[1] == 1), default=0)
    c("no attempt-1 window after the crash", last_end_after <= kill_ms + 2000)
    ok, _ = gpu_sharing_ok()
    c("no GPU double-allocated", ok)
    cancel_all(stack, ids)
    wait_states(stack, ids, TERMINAL, 60, "jobs cancelled")
    time.sleep(2)
    c("job totals equal their windows", costs_consistent(ids))
    return CaseResult("agent kill -9", c.passed, f, c.results)


def broker_cut(ctx) -> CaseResult:
    """Cut the agent's broker link (a TCP proxy in front of Redis) while jobs run:
    no usage window lost or doubled, jobs keep running, the platform catches up."""
    from .proxy import CuttableProxy

    cut_s = 20 if ctx.quick else 60
    # The node must not be declared down during the cut: heartbeats 1 s, down after cut + 40 s.
    stack = stack_start(
        ctx,
        "broker-cut",
        agent=False,
        env={"GPUSHARE_HEARTBEAT_INTERVAL_S": "1", "GPUSHARE_MISSED_HEARTBEATS_DOWN": str(cut_s + 40)},
    )
    url = urlparse(stack.config.redis_url)
    proxy = CuttableProxy(url.hostname or "127.0.0.1", url.port or 6379)
    c, f = Checks(), {"cut_s": cut_s}
    try:
        stack.agent_start(broker_url=f"redis://127.0.0.1:{proxy.port}{url.path}")
        ids = [submit(stack, sleep_job(6008)) for _ in range(2)]
        wait_states(stack, ids, {"running"}, 60, "jobs running")
        time.sleep(3)
        before = len(windows_of(ids))
        proxy.cut()
        t_cut = time.monotonic()
        time.sleep(cut_s)
        during = len(windows_of(ids))
        proxy.restore()
        f["refused_connects"] = proxy.refused
        f["windows_before_cut"], f["windows_arrived_during_cut"] = before, during - before
        c("jobs kept running through the cut", set(states(ids).values()) == {"running"})

        # Caught up: every job's latest stored window ends within a few windows of now.
        def caught_up() -> bool:
            now_ms = time.time() * 1000
            ends: dict[int, int] = {}
            for w in windows_of(ids):
                ends[w[0]] = max(ends.get(w[0], 0), w[4])
            return len(ends) == len(ids) and all(end >= now_ms - 5000 for end in ends.values())

        t_restore = time.monotonic()
        f["catch_up_s"] = time.monotonic() - t_restore if eventually(stack, caught_up, 90, "catch-up") else None
        f["cut_lasted_s"] = round(t_restore - t_cut, 1)
        cancel_all(stack, ids)
        wait_states(stack, ids, TERMINAL, 60, "jobs cancelled")
        time.sleep(3)
        rows = windows_of(ids)
        f["windows"] = len(rows)
        from django_scopes import scopes_disabled

        from scheduler.models import Job

        with scopes_disabled():
            jobs = {j.pk: j for j in Job.objects.filter(pk__in=ids)}
        tiled = True
        for job_id in ids:
            mine = [w for w in rows if w[0] == job_id]
            seqs = [w[2] for w in mine]
            job = jobs[job_id]
            tiled &= seqs == list(range(len(mine)))
            tiled &= all(a[4] == b[3] for a, b in zip(mine, mine[1:], strict=False))
            held = mine[-1][4] - mine[0][3] if mine else 0
            run_ms = round((job.finished_at - job.started_at).total_seconds() * 1000) if job.finished_at else -1
            tiled &= held == run_ms
        c("every window once: no gap, no overlap, covering the whole run", tiled)
        c("platform caught up after the link came back", f["catch_up_s"] is not None)
        c("job totals equal their windows", costs_consistent(ids))
    finally:
        proxy.close()
    return CaseResult("broker link cut", c.passed, f, c.results)


def worker_kill_ingest(ctx) -> CaseResult:
    """kill -9 the Celery worker while it ingests usage: every window stored once, charged once."""
    from bench.fixtures import finished_jobs_create
    from bench.ingest import stored, windows_for
    from gpushare.celery import app

    stack = stack_start(ctx, "worker-kill-ingest")
    c, f = Checks(), {}
    job_ids = finished_jobs_create(tenant_id=stack.tenant_id, node_name=stack.config.node, count=20)
    per_job = 500 if ctx.quick else 1000
    messages = windows_for(job_ids, per_job, int(time.time() * 1000) - per_job * 1000 - 60_000)
    total = len(job_ids) * per_job
    creds = {"node": stack.config.node, "token": stack.node_token}
    for windows in messages:
        app.send_task("agents.usage", kwargs={**creds, "windows": windows}, queue=REPORT_QUEUE)
    stack.wait(lambda: stored(job_ids) >= total // 5, 120, "ingest under way")
    f["stored_at_kill"] = stored(job_ids)
    stack.procs["worker"].kill()
    stack.worker_start("worker2")
    t0 = time.monotonic()
    try:
        # Messages the killed worker had taken come back after the broker's visibility timeout.
        from agents.agent.brokerconf import VISIBILITY_TIMEOUT_S

        # kombu scans for them every 10th 10 s tick (restore_visible's interval): up to 100 s more.
        stack.wait(lambda: stored(job_ids) >= total, VISIBILITY_TIMEOUT_S + 160, "every window stored")
        f["recovered_s"] = time.monotonic() - t0
    except Exception:  # noqa: BLE001
        f["recovered_s"] = None
    f["stored"], f["expected"] = stored(job_ids), total
    c("no window lost", f["stored"] == total)
    c("no window stored twice", f["stored"] <= total)
    c("job totals equal their windows (no double charge)", costs_consistent(job_ids))
    return CaseResult("worker kill -9 during ingest", c.passed, f, c.results)


def outbox_pending(stack) -> int:
    """Reports in the agent's outbox not yet acknowledged by the platform."""
    import sqlite3

    path = stack.var_dir / "agent" / "agent" / stack.config.node / "state.sqlite3"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    finally:
        db.close()


def runs_covered(job_ids) -> tuple[int, int, int]:
    """(jobs whose windows cover their run exactly, windows, gaps): seqs 0..n-1, contiguous, start to finish."""
    from django_scopes import scopes_disabled

    from scheduler.models import Job

    def ms(value):
        return int(value.timestamp() * 1000)

    by_job: dict[int, list[tuple]] = {}
    for job_id, _attempt, seq, start, end, _amount in windows_of(job_ids):
        by_job.setdefault(job_id, []).append((seq, start, end))
    covered = gaps = 0
    with scopes_disabled():
        for job in Job.objects.filter(pk__in=job_ids):
            ws = by_job.get(job.pk, [])
            seqs_ok = [w[0] for w in ws] == list(range(len(ws)))
            joined = all(a[2] == b[1] for a, b in zip(ws, ws[1:], strict=False))
            ends_ok = bool(ws) and ws[0][1] == ms(job.started_at) and ws[-1][2] == ms(job.finished_at)
            if seqs_ok and joined and ends_ok:
                covered += 1
            else:
                gaps += 1
    return covered, sum(len(w) for w in by_job.values()), gaps


def agent_reports_worker_kills(ctx) -> CaseResult:
    """kill -9 the worker at random instants while a real agent reports: every window delivered, stored once."""
    import random

    from agents.models import QuarantinedWindow

    rounds = 5
    stack = stack_start(
        ctx,
        "agent-reports-worker-kills",
        agent_kwargs={"sample_interval_s": 0.1, "window_s": 0.3, "env": {"GPUSHARE_AGENT_RESEND_S": "5"}},
    )
    c, f = Checks(), {"rounds": rounds}
    seconds = 12 if ctx.quick else 25
    ids = [submit(stack, sleep_job(seconds)) for _ in range(4)]
    wait_states(stack, ids, {"running"}, 60, "jobs running")
    rng = random.Random(int(time.time()))
    kills = []
    for i in range(rounds):
        time.sleep(rng.uniform(0.5, seconds / rounds))
        kills.append(round(time.monotonic(), 2))
        stack.procs["worker" if i == 0 else f"worker{i}"].kill()
        stack.worker_start(f"worker{i + 1}")
    f["kills"] = len(kills)
    wait_states(stack, ids, TERMINAL, seconds + 120, "jobs finished")
    c("every job succeeded", all(s == "succeeded" for s in states(ids).values()))
    c(
        "the agent's outbox drained (every report acknowledged)",
        eventually(stack, lambda: outbox_pending(stack) == 0, 90, "outbox empty"),
    )
    covered, f["windows"], f["jobs_with_gaps"] = runs_covered(ids)
    c("no window lost: each job's windows cover its run exactly", covered == len(ids))
    c("job totals equal their windows (no double charge)", costs_consistent(ids))
    c("nothing quarantined", not QuarantinedWindow.objects.exists())
    return CaseResult("worker kill -9 at random instants while an agent reports (5 rounds)", c.passed, f, c.results)


def _redis_server(port: int) -> subprocess.Popen:
    """A private Redis on ``port`` that keeps nothing on disk (a restart loses every key and message)."""
    import redis

    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return server
        except redis.RedisError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


def broker_restart(ctx) -> CaseResult:
    """kill -9 the broker itself (a private Redis without persistence) while an agent reports, start it
    again empty: every queued message, binding and unacknowledged delivery is gone. The agent's outbox
    re-sends what the platform never acknowledged; every window is stored once, every job finishes."""
    from agents.models import QuarantinedWindow
    from bench.slurm import free_port

    port = free_port()
    server = _redis_server(port)
    c, f = Checks(), {"down_s": 3}
    try:
        stack = stack_start(
            ctx,
            "broker-restart",
            redis_url=f"redis://127.0.0.1:{port}/0",
            env={"GPUSHARE_HEARTBEAT_INTERVAL_S": "1", "GPUSHARE_MISSED_HEARTBEATS_DOWN": "60"},
            agent_kwargs={"sample_interval_s": 0.1, "window_s": 0.3, "env": {"GPUSHARE_AGENT_RESEND_S": "5"}},
        )
        seconds = 15 if ctx.quick else 30
        ids = [submit(stack, sleep_job(seconds)) for _ in range(4)]
        wait_states(stack, ids, {"running"}, 60, "jobs running")
        time.sleep(seconds / 3)
        f["windows_before"] = len(windows_of(ids))
        server.kill()  # SIGKILL: no shutdown save, and nothing to save anyway
        server.wait(10)
        time.sleep(f["down_s"])
        server = _redis_server(port)  # back, empty
        f["restarted_at_s"] = round(seconds / 3 + f["down_s"], 1)
        wait_states(stack, ids, TERMINAL, seconds + 180, "jobs finished after the restart")
        c("every job succeeded", all(s == "succeeded" for s in states(ids).values()))
        c(
            "the agent's outbox drained (every report acknowledged after the restart)",
            eventually(stack, lambda: outbox_pending(stack) == 0, 120, "outbox empty"),
        )
        covered, f["windows"], f["jobs_with_gaps"] = runs_covered(ids)
        c("no window lost: each job's windows cover its run exactly", covered == len(ids))
        c("job totals equal their windows (no double charge)", costs_consistent(ids))
        c("nothing quarantined", not QuarantinedWindow.objects.exists())
        after = [submit(stack, sleep_job(1)) for _ in range(2)]  # the link works both ways again
        wait_states(stack, after, TERMINAL, 90, "new jobs after the restart")
        c("new jobs run after the restart", all(s == "succeeded" for s in states(after).values()))
    finally:
        for stack in list(ctx.stacks):
            if stack.config.redis_url.endswith(f":{port}/0"):
                stack.stop()
                ctx.stacks.remove(stack)
        server.kill()
        server.wait(10)
    return CaseResult("broker (Redis) killed and restarted empty while an agent reports", c.passed, f, c.results)


def worker_kill_pass(ctx) -> CaseResult:
    """kill -9 the Celery worker during a scheduling pass: no double placement, nothing stuck.

    The kill has to land inside a pass (or between its commit and its launch
    messages) to matter, so the case does it several times, each time at a
    different delay after the pass was requested.
    """
    from django.db import connections

    from bench.workload import api_body, workload

    stack = stack_start(ctx, "worker-kill-pass", gpus="sim:8xH100-80GB")
    c, f = Checks(), {"rounds": []}
    session = stack.session()
    per_round = 40 if ctx.quick else 60
    delays = (0.1, 0.3) if ctx.quick else (0.1, 0.25, 0.4)
    violations = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            ok, _ = gpu_sharing_ok()
            if not ok:
                violations.append(time.monotonic())
            time.sleep(0.2)
        connections.close_all()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ids: list[int] = []
    worker = "worker"
    for i, delay in enumerate(delays):
        stack.node_state_set("cordoned")
        batch = [submit(stack, api_body(milli, "sleep 1"), session) for milli in workload(per_round)]
        ids += batch
        stack.node_state_set("up")
        stack.schedule_pass_request()
        time.sleep(delay)
        stack.procs[worker].kill()
        placed = sum(1 for s in states(batch).values() if s != "queued")
        f["rounds"].append({"kill_after_s": delay, "placed_at_kill": placed})
        worker = f"worker{i + 2}"
        stack.worker_start(worker)
    t0 = time.monotonic()
    finished = eventually(stack, lambda: all(s in TERMINAL for s in states(ids).values()), 90, "every job finished")
    f["all_finished_s"] = time.monotonic() - t0 if finished else None
    stop.set()
    watcher.join(timeout=5)
    final = list(states(ids).values())
    f["jobs"] = len(ids)
    f["stuck"] = {s: n for s in ("queued", "scheduled", "running") if (n := final.count(s))}
    f["succeeded"] = final.count("succeeded")
    c("no GPU ever over-committed", not violations)
    c("every job finished (none stuck scheduled)", finished)
    c("every job succeeded once", f["succeeded"] == len(ids))
    return CaseResult("worker kill -9 during a pass", c.passed, f, c.results)


def db_connections_killed(ctx) -> CaseResult:
    """pg_terminate_backend on every platform connection: web and workers recover unaided.

    (A PostgreSQL restart is not allowed on this shared machine; killing the
    platform's connections is what web and workers see of one.) Web threads
    and worker processes both keep their connections between requests and
    tasks (CONN_MAX_AGE, see gpushare/celery.py), so both lose live ones here;
    each checks its connection before reusing it and replaces a dead one.
    """
    from django.db import connection

    stack = stack_start(ctx, "db-connections-killed")
    c, f = Checks(), {}
    session = stack.session()
    submit(stack, {"kind": "training", "gpus": 1, "command": ["true"]}, session)
    for _ in range(30):  # every web worker holds a connection now
        session.get(f"{stack.url}/api/v1/jobs/", timeout=30)
    time.sleep(2)
    with connection.cursor() as cur:
        # Each kill waits for its backend to end (up to 5 s), as a restart does before the server answers
        # again: pg_terminate_backend alone only signals it, and a request in the moment before the backend
        # closes its socket finds a connection that still looks idle and healthy (one 500 in session 30's run).
        cur.execute(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        f["connections_killed"] = cur.fetchone()[0]
    statuses = [session.get(f"{stack.url}/api/v1/jobs/", timeout=30).status_code for _ in range(20)]
    f["errors_after_kill"] = sum(1 for s in statuses if s >= 500)
    t0 = time.monotonic()
    job = submit(stack, {"kind": "training", "gpus": 1, "command": ["true"]}, session)
    try:
        wait_states(stack, [job], {"succeeded"}, 60, "a job submitted after the kill to succeed")
        f["job_after_kill_s"] = time.monotonic() - t0
    except Exception:  # noqa: BLE001
        f["job_after_kill_s"] = None
    c("web and worker connections were killed (the check is not vacuous)", f["connections_killed"] >= 2)
    c("the API answers without a server error", f["errors_after_kill"] == 0)
    c("a job submitted after the kill runs to success", f["job_after_kill_s"] is not None)
    return CaseResult("DB connections killed", c.passed, f, c.results)


def quota_burst(ctx) -> CaseResult:
    """100 concurrent submits against a tenant quota of 10 GPUs: never more than 10 held."""
    from concurrent.futures import ThreadPoolExecutor

    from django_scopes import scopes_disabled

    stack = stack_start(ctx, "quota-burst", gpus="sim:16xH100-80GB")
    c, f = Checks(), {}
    try:
        from accounts.models import TenantQuota
    except ImportError:
        return CaseResult("quota burst", False, {}, {}, "accounts.models.TenantQuota is missing")
    with scopes_disabled():
        TenantQuota.objects.update_or_create(tenant_id=stack.tenant_id, defaults={"max_dedicated_gpus": 10})
    held_max = 0
    stop = threading.Event()
    from django.db import connection, connections

    def held() -> int:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM scheduler_allocation WHERE released_at IS NULL AND share_milli = 1000 "
                "AND tenant_id = %s",
                [stack.tenant_id],
            )
            return cur.fetchone()[0]

    def watch():
        nonlocal held_max
        while not stop.is_set():
            held_max = max(held_max, held())
            time.sleep(0.1)
        connections.close_all()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    body = {"kind": "training", "gpus": 1, "command": ["sleep", "3"]}

    def one(_):
        s = stack.session()
        return s.post(f"{stack.url}/api/v1/jobs/", json=body, timeout=60).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(one, range(100)))
    f["accepted"] = codes.count(201)
    f["refused_4xx"] = sum(1 for x in codes if 400 <= x < 500)
    f["server_errors"] = sum(1 for x in codes if x >= 500)
    time.sleep(15 if ctx.quick else 25)
    stop.set()
    watcher.join(timeout=5)
    f["held_max"] = held_max
    c("never more than 10 GPUs held", held_max <= 10)
    c("the quota was reached (the check is not vacuous)", held_max >= 10)
    c("no server error", f["server_errors"] == 0)
    return CaseResult("100 submits vs quota 10", c.passed, f, c.results)


def job_containment(ctx) -> CaseResult:
    """A job that forks children, one that ignores SIGTERM, one that fills its log: contained."""
    stack = stack_start(ctx, "containment", agent_kwargs={"extra": ("--log-cap-mb", "1")})
    c, f = Checks(), {}
    jobs = {
        "forks": ["sh", "-c", "sleep 6009 & sleep 6009 & (sleep 6009 &) ; sleep 6009"],
        "ignores_sigterm": ["sh", "-c", "trap '' TERM; sleep 6009 & sleep 6009; wait"],
        "fills_log": ["sh", "-c", "yes chaos-log-fill-6009"],
    }
    ids = {name: submit(stack, {"kind": "training", "gpus": 1, "command": cmd}) for name, cmd in jobs.items()}
    wait_states(stack, list(ids.values()), {"running"}, 60, "the 3 jobs running")
    time.sleep(4)
    f["processes_while_running"] = len(marker_processes("6009"))
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT COALESCE(SUM(length(data)), 0) FROM scheduler_joblogchunk WHERE job_id = %s", [ids["fills_log"]]
        )
        f["log_bytes_stored"] = cur.fetchone()[0]
    cancel_all(stack, ids.values())
    t0 = time.monotonic()
    try:
        wait_states(stack, list(ids.values()), TERMINAL, 40, "the 3 jobs to end")
        f["ended_after_cancel_s"] = time.monotonic() - t0
    except Exception:  # noqa: BLE001
        f["ended_after_cancel_s"] = None
    time.sleep(1)
    f["processes_left"] = len(marker_processes("6009"))
    c("log capped at 1 MiB (+ one chunk)", f["log_bytes_stored"] <= (1 << 20) + 65536 * 2)
    c("all 3 jobs ended after cancel (SIGKILL after the grace period)", f["ended_after_cancel_s"] is not None)
    c("no process of them left (children included)", f["processes_left"] == 0)
    c("the agent survived", stack.procs["agent"].alive)
    return CaseResult("fork / ignore SIGTERM / log flood", c.passed, f, c.results)


def stripe_outage(ctx) -> CaseResult:
    """Stripe (localstripe) down, then answering 500, during invoice sync: retried with the
    same idempotency keys, exactly one invoice and one item per line at Stripe."""
    from django_scopes import scopes_disabled

    with scopes_disabled():
        return _stripe_outage(ctx)


def _stripe_outage(ctx) -> CaseResult:
    import sys

    import requests
    from django_scopes import scopes_disabled

    from bench.fixtures import finished_jobs_create
    from bench.slurm import free_port
    from bench.stack import Proc

    from .proxy import CuttableProxy

    try:
        from billing.gateway import GatewayError, StripeGateway
        from billing.services.ingest import usage_windows_ingest
        from billing.services.invoices import invoices_close_month
        from billing.services.payments import invoice_send
    except ImportError as exc:
        return CaseResult("Stripe outage", False, error=f"billing's Stripe module is missing: {exc}")
    stack = stack_start(ctx, "stripe-outage")
    c, f = Checks(), {}
    port = free_port()
    stripe_proc = Proc(
        "localstripe",
        [sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"],
        dict(os.environ),
        stack.workdir / "localstripe.log",
    ).start()
    stack.procs["localstripe"] = stripe_proc
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{base}/v1/customers", auth=("sk_test_local", ""), timeout=1).status_code == 200
        except requests.RequestException:
            return False

    stack.wait(up, 60, "localstripe", "localstripe")
    proxy = CuttableProxy("127.0.0.1", port)
    try:
        from agents.models import Node

        job_id = finished_jobs_create(tenant_id=stack.tenant_id, node_name=stack.config.node, count=1)[0]
        start = int(time.time() * 1000) - 600_000
        usage_windows_ingest(
            node=Node.objects.get(name=stack.config.node),
            windows=[
                {
                    "job_id": job_id,
                    "attempt": 1,
                    "seq": i,
                    "start_ms": start + i * 10_000,
                    "end_ms": start + (i + 1) * 10_000,
                }
                for i in range(10)
            ],
        )
        with scopes_disabled():
            from billing.models import Charge

            month = Charge.objects.filter(job_id=job_id).first().month
        invoice = invoices_close_month(month=month)[0]
        lines = invoice.lines.filter(amount__gt=0).count()
        gw = StripeGateway(api_key="sk_test_local", api_base=f"http://127.0.0.1:{proxy.port}", localstripe=True)
        outcomes = []
        for mode in ("down", "500", "up"):
            {"down": proxy.cut, "500": proxy.http_500, "up": proxy.restore}[mode]()
            try:
                invoice_send(invoice_id=invoice.pk, gw=gw)
                outcomes.append((mode, "sent"))
            except GatewayError as exc:
                outcomes.append((mode, f"transient={exc.transient}"))
        # A retry after success changes nothing.
        invoice_send(invoice_id=invoice.pk, gw=gw)
        f["attempts"] = outcomes
        f["http_500_answers"] = proxy.answered_500
        invoice.refresh_from_db()
        f["invoice_state"] = invoice.state
        auth = ("sk_test_local", "")
        customer = invoice.stripe_customer_id
        remote_invoices = (
            requests.get(f"{base}/v1/invoices", params={"customer": customer}, auth=auth, timeout=10)
            .json()
            .get("data", [])
        )
        ours = [
            i
            for i in remote_invoices
            if str(i.get("metadata", {}).get("invoice_id", "")) == str(invoice.pk)
            or i.get("id") == invoice.stripe_invoice_id
        ]
        # The invoice's own lines at Stripe, less localstripe's $0 subscription line.
        items = [x for i in ours for x in i.get("lines", {}).get("data", []) if x.get("amount")]
        f["stripe_invoices"], f["stripe_items"], f["lines"] = len(ours), len(items), lines
        c(
            "failures while Stripe is down or 500 are transient (retryable)",
            all(o == "transient=True" for m, o in outcomes if m != "up"),
        )
        c("sent once Stripe is back", outcomes[-1][1] == "sent" and invoice.state != "draft")
        c("exactly one invoice at Stripe", len(ours) == 1)
        c("exactly one item per line at Stripe", len(items) == lines)
    finally:
        proxy.close()
    return CaseResult("Stripe down / 500", c.passed, f, c.results)


CASES = {
    "agent-kill9": agent_kill9,
    "broker-cut": broker_cut,
    "worker-kill-ingest": worker_kill_ingest,
    "agent-reports-worker-kills": agent_reports_worker_kills,
    "broker-restart": broker_restart,
    "worker-kill-pass": worker_kill_pass,
    "db-connections": db_connections_killed,
    "quota-burst": quota_burst,
    "containment": job_containment,
    "stripe-outage": stripe_outage,
}
