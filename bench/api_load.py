"""Benchmark: the API under load (wrk, 50 connections) vs the same server's trivial endpoint.

Endpoints, each with the tenant's Bearer token through the web server (gpushare.serve):
- ``GET /api/v1/jobs/`` (first page) with N finished jobs in the database
  (bulk-inserted history: 100,000, or 10,000 with --quick);
- ``POST /api/v1/jobs/`` (the node is cordoned so the submitted jobs stay queued);
- ``GET /api/v1/`` (the API root: same authentication, throttle and rendering,
  no query of its own) as the ceiling.
Goal: p99 < 100 ms and >= 30% of the ceiling's throughput.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from django_scopes import scopes_disabled

from .fixtures import finished_jobs_create
from .openloop import fixed_rate
from .stats import Row, median

CONNECTIONS = 50

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def duration_ms(text: str) -> float:
    """wrk's '12.34ms' / '1.2s' / '850.00us' -> milliseconds."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not match:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def wrk_parse(output: str) -> dict:
    """Requests/s, latency percentiles (ms), errors and non-2xx count from ``wrk --latency``."""
    out: dict = {"non_2xx": 0, "socket_errors": 0}
    if m := re.search(r"Requests/sec:\s+([\d.]+)", output):
        out["rps"] = float(m.group(1))
    for pct, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", output, flags=re.M):
        out[f"p{pct}_ms"] = duration_ms(value)
    if m := re.search(r"(\d+) requests in", output):
        out["requests"] = int(m.group(1))
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", output):
        out["non_2xx"] = int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output):
        out["socket_errors"] = sum(int(x) for x in m.groups())
    return out


def wrk_script(method: str, token: str, body: dict | None) -> str:
    lines = [f'wrk.method = "{method}"', f'wrk.headers["Authorization"] = "Bearer {token}"']
    if body is not None:
        lines += ['wrk.headers["Content-Type"] = "application/json"', f"wrk.body = {json.dumps(json.dumps(body))}"]
    return "\n".join(lines) + "\n"


def wrk_run(url: str, script_path, seconds: int) -> dict:
    if not shutil.which("wrk"):
        from .tools import apt_install

        apt_install(("wrk",), binaries=("wrk",))
    result = subprocess.run(
        [
            "wrk",
            "-t2",
            f"-c{CONNECTIONS}",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            "--latency",
            "-s",
            str(script_path),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    parsed = wrk_parse(result.stdout)
    parsed["raw"] = result.stdout
    return parsed


FIXED_RATE = 100  # requests per second, open loop


def fixed_rate_runs(ctx, stack, *, seconds: int) -> dict:
    """List, detail and submit at a fixed 100 req/s each (open loop: latency from each request's due time)."""
    from scheduler.models import Job

    headers = {"Authorization": f"Bearer {stack.tenant_token}"}
    with scopes_disabled():
        job_id = Job.objects.filter(tenant_id=stack.tenant_id).order_by("-id").values_list("pk", flat=True).first()
    submit = {"kind": "inference", "gpus": 0.125, "command": ["true"]}
    plans = {
        "list": (f"{stack.url}/api/v1/jobs/", "GET", None),
        "detail": (f"{stack.url}/api/v1/jobs/{job_id}/", "GET", None),
        "logs": (f"{stack.url}/api/v1/jobs/{job_id}/logs/", "GET", None),
        "submit": (f"{stack.url}/api/v1/jobs/", "POST", submit),
    }
    out = {}
    for name, (url, method, body) in plans.items():
        out[name] = fixed_rate(url, rate=FIXED_RATE, seconds=seconds, method=method, headers=headers, body=body)
        r = out[name]
        ctx.log(
            f"  api fixed {FIXED_RATE}/s {name}: p50 {r.get('p50_ms')} ms, p99 {r.get('p99_ms')} ms, "
            f"p99.9 {r.get('p999_ms')} ms, errors {r['errors']}"
        )
        stack.jobs_cancel_queued()
    return out


def fixed_rate_rows(fixed: dict) -> list[Row]:
    rows = []
    for name, r in fixed.items():
        for q, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9")):
            rows.append(
                Row(
                    "api",
                    f"job {name} at a fixed {FIXED_RATE} req/s, {label}",
                    r.get(q),
                    "ms",
                    goal="< 100 ms" if label == "p99" else "",
                    goal_met=(r.get(q, 1e9) < 100 and r["errors"] == 0) if label == "p99" else None,
                    note=f"{r['sent']} requests, errors {r['errors']}",
                )
            )
    return rows


def run(ctx) -> tuple[list[Row], dict]:
    stack = ctx.stack()
    history = 10_000 if ctx.quick else 100_000
    seconds = 5 if ctx.quick else 10
    runs_n = 3
    ctx.log(f"  api: bulk-inserting {history:,} finished jobs")
    finished_jobs_create(tenant_id=stack.tenant_id, node_name=stack.config.node, count=history)
    from django.db import connection

    with connection.cursor() as cur:
        # What autovacuum does within a minute of a bulk insert on a stock PostgreSQL (the test server runs
        # with it off): without a visibility map every COUNT(*) for the page count reads the whole heap.
        cur.execute("VACUUM ANALYZE scheduler_job")
        cur.execute("ANALYZE")
    submit = {"kind": "inference", "gpus": 0.125, "command": ["true"]}
    targets = {
        "bare": (f"{stack.url}/bench/bare/", "GET", None),
        "ceiling": (f"{stack.url}/api/v1/", "GET", None),
        "list": (f"{stack.url}/api/v1/jobs/", "GET", None),
        "submit": (f"{stack.url}/api/v1/jobs/", "POST", submit),
    }
    session = stack.session()
    for name, (url, method, body) in targets.items():
        r = session.request(method, url, json=body, timeout=30)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"{name}: {method} {url} answered {r.status_code}: {r.text[:300]}")
    stack.node_state_set("cordoned")
    stack.jobs_cancel_queued()  # the check's submit: every run starts with no job queued
    results: dict = {name: [] for name in targets}
    try:
        for i in range(runs_n):
            for name, (url, method, body) in targets.items():
                script = ctx.workdir / f"wrk-{name}.lua"
                script.write_text(wrk_script(method, stack.tenant_token, body))
                res = wrk_run(url, script, seconds)
                results[name].append(res)
                ctx.log(
                    f"  api run {i + 1} {name}: {res.get('rps', 0):.0f} req/s, p50 {res.get('p50_ms', 0):.0f} ms,"
                    f" p99 {res.get('p99_ms', 0):.0f} ms, non-2xx {res['non_2xx']}, socket errors "
                    f"{res['socket_errors']}"
                )
            stack.jobs_cancel_queued()
            stack.tables_settle()
        fixed = fixed_rate_runs(ctx, stack, seconds=10 if ctx.quick else 20)
    finally:
        stack.jobs_cancel_queued()
        stack.node_state_set("up")
    rows = fixed_rate_rows(fixed)
    ceiling = median(r["rps"] for r in results["ceiling"])
    bare = median(r["rps"] for r in results["bare"])
    rows.append(
        Row(
            "api",
            f"trivial endpoint GET /api/v1/ (auth, throttle, DRF), {CONNECTIONS} conns",
            ceiling,
            "req/s",
            bare,
            "bare Django view (server ceiling)",
            goal=">= 50% of the bare view",
            goal_met=ceiling >= 0.5 * bare,
            runs=runs_n,
        )
    )
    for name, label in (("list", f"job list ({history:,} jobs in DB)"), ("submit", "job submit")):
        rps = median(r["rps"] for r in results[name])
        p50 = median(r["p50_ms"] for r in results[name])
        p99 = median(r["p99_ms"] for r in results[name])
        errors = sum(r["non_2xx"] + r["socket_errors"] for r in results[name])
        met = rps >= 0.5 * ceiling and errors == 0
        rows.append(
            Row(
                "api",
                f"{label}, {CONNECTIONS} conns",
                rps,
                "req/s",
                ceiling,
                "GET /api/v1/ (trivial)",
                goal=">= 50% of trivial",
                goal_met=met,
                runs=runs_n,
                note=f"errors {errors}",
            )
        )
        rows.append(
            Row(
                "api",
                f"{label} p50",
                p50,
                "ms",
                median(r["p50_ms"] for r in results["ceiling"]),
                "GET /api/v1/",
                higher_is_better=False,
                runs=runs_n,
            )
        )
        rows.append(
            Row(
                "api",
                f"{label} p99",
                p99,
                "ms",
                median(r["p99_ms"] for r in results["ceiling"]),
                "GET /api/v1/",
                higher_is_better=False,
                runs=runs_n,
            )
        )
    for runs in results.values():
        for r in runs:
            r.pop("raw", None)
    return rows, {
        "history_jobs": history,
        "seconds_per_run": seconds,
        "connections": CONNECTIONS,
        "web_workers": stack.config.web_workers,
        "web_threads": stack.config.web_threads,
        "results": results,
        "fixed_rate": fixed,
    }
