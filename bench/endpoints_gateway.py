"""Gateway overhead: p50/p99 added latency of the endpoint gateway against
calling a replica directly, at 100 concurrent requests and at a fixed 500 req/s
(open loop). The gateway runs in a process of its own (as deployed), not in the
load generator's event loop.

    python -m bench.endpoints_gateway [--quick]

The replica is tests/endpoints/model_server.py (answers at once); the gateway
is the real gateway (endpoints.gateway) with its routing table and token
check fixed in memory, so the figure is the proxy path itself: routing,
least-outstanding choice, forwarding and streaming the answer back.

Cold start (zero replicas to first answer) runs the whole platform
(bench.stack: the web server, a Celery worker with beat, a node agent on simulated
GPUs) and a real gateway process: deploy a min-0 endpoint, time the first
request through the gateway (held while the autoscaler starts a replica, the
scheduler places it, the agent starts it and it passes its health check),
delete the endpoint; a few times.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from aiohttp import ClientError, ClientSession, TCPConnector

from bench.agent_overhead import cpu_seconds
from bench.openloop import _run as _fixed_rate_run

ROOT = Path(__file__).resolve().parent.parent
MODEL_SERVER = ROOT / "tests" / "endpoints" / "model_server.py"


FIXED_RATE = 500  # requests per second, open loop (bench.openloop)
FIXED_SECONDS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(url: str, *, requests: int, concurrency: int, headers: dict) -> dict:
    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with ClientSession(connector=TCPConnector(limit=concurrency)) as session:

        async def worker():
            nonlocal errors
            while not queue.empty():
                queue.get_nowait()
                started = time.perf_counter()
                try:
                    async with session.post(url, data=b"x", headers=headers) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                except ClientError:
                    errors += 1
                    continue
                latencies.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "p50_ms": round(pct(latencies, 0.5), 2),
        "p99_ms": round(pct(latencies, 0.99), 2),
        "rps": round(requests / elapsed, 1),
        "errors": errors,
    }


async def _fixed_rate(url: str, *, rate: float, seconds: float, method: str, headers: dict) -> dict:
    return await _fixed_rate_run(url, rate=rate, seconds=seconds, method=method, headers=headers, body=None,
                                 connections=256)  # fmt: skip


def serve_static(gateway_port: int, replica_port: int) -> None:
    """The real gateway app in a process of its own (as deployed: uvloop, its own core), with its
    routing table and token check fixed in memory: ``python -m bench.endpoints_gateway --serve ...``."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    import django

    django.setup()
    from endpoints import gateway as gw
    from endpoints.selectors import EndpointRoute, Route

    route = EndpointRoute(1, 1, "bench", "echo", "/health", 1, 60, (Route(1, "127.0.0.1", replica_port, "ready", 1),))

    class StaticGateway(gw.Gateway):
        async def refresh(self):
            self.table = {("bench", "echo"): route}

        async def health_check(self):
            pass

        async def report(self):
            pass

        async def poke_autoscaler(self, endpoint_id):
            pass  # no platform here: a retry that found no other replica used to reach the database

        async def principal(self, plaintext, tenant_slug):
            return None

    gw.serve_forever(gw.run(StaticGateway(refresh_s=1.0), "127.0.0.1", gateway_port))


async def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


async def measure(*, requests: int, concurrency: int) -> dict:
    replica_port, gateway_port = free_port(), free_port()
    replica = subprocess.Popen(
        [sys.executable, str(MODEL_SERVER)], env={**os.environ, "PORT": str(replica_port), "SLEEP_S": "0"}
    )
    gateway = subprocess.Popen(
        [sys.executable, "-m", "bench.endpoints_gateway", "--serve", str(gateway_port), str(replica_port)], cwd=ROOT
    )
    try:
        await _wait_port(replica_port)
        await _wait_port(gateway_port)
        await asyncio.sleep(1.0)
        headers = {"Authorization": "Bearer bench"}
        direct_url = f"http://127.0.0.1:{replica_port}/predict"
        via_url = f"http://127.0.0.1:{gateway_port}/e/bench/echo/predict"
        await load(direct_url, requests=200, concurrency=concurrency, headers=headers)  # warm up
        runs = []
        cpu = {"gateway": 0.0, "replica": 0.0}  # CPU seconds of each process over the runs through the gateway
        for _ in range(3):
            direct = await load(direct_url, requests=requests, concurrency=concurrency, headers=headers)
            before = {name: cpu_seconds(proc.pid) for name, proc in (("gateway", gateway), ("replica", replica))}
            via = await load(via_url, requests=requests, concurrency=concurrency, headers=headers)
            for name, proc in (("gateway", gateway), ("replica", replica)):
                cpu[name] += cpu_seconds(proc.pid) - before[name]
            runs.append((direct, via))
        fixed = {}
        for name, url in (("direct", direct_url), ("gateway", via_url)):
            fixed[name] = await _fixed_rate(url, rate=FIXED_RATE, seconds=FIXED_SECONDS, method="POST",
                                            headers=headers)  # fmt: skip
    finally:
        for proc in (gateway, replica):
            proc.terminate()
            proc.wait(timeout=10)
    median = sorted(runs, key=lambda r: r[1]["p50_ms"] - r[0]["p50_ms"])[len(runs) // 2]
    direct, via = median
    return {
        "concurrency": concurrency,
        "requests": requests,
        "direct": direct,
        "gateway": via,
        "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 2),
        "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 2),
        # CPU a request costs each process (the figure a loaded machine disturbs least)
        "cpu_us_per_request": {name: round(seconds / (3 * requests) * 1e6) for name, seconds in cpu.items()},
        "fixed_rate": fixed,
    }


COLD_DATABASE_URL = os.environ.get("BENCH_COLD_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpushare_bench_cold")
COLD_REDIS_URL = os.environ.get("BENCH_COLD_REDIS_URL", "redis://127.0.0.1:6379/5")


def cold_start_measured(*, runs: int) -> dict:
    """``cold_start`` in a process of its own: its stack has its own database, which this
    process's Django (configured for another one, or not at all) cannot switch to."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.endpoints_gateway", "--cold-start", str(runs)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"cold start bench failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cold_start(*, runs: int) -> dict:
    """Seconds from a min-0 endpoint's first request to its answer, on the whole simulated platform."""
    from bench.stack import Stack, StackConfig

    config = StackConfig(database_url=COLD_DATABASE_URL, redis_url=COLD_REDIS_URL, gpus="sim:2xL4-24GB")
    stack = Stack(Path(tempfile.mkdtemp(prefix="gpushare-bench-cold-")), config)
    samples: list[float] = []
    try:
        stack.start()
        stack.wait(stack.node_up, 60, "the node agent", "agent")
        port = free_port()
        stack._proc("gateway", [sys.executable, "-m", "endpoints", "--port", str(port), "--refresh", "0.25"]).start()

        def gateway_up() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok
            except requests.ConnectionError:
                return False

        stack.wait(gateway_up, 60, "the gateway", "gateway")
        api = stack.session()
        auth = {"Authorization": f"Bearer {stack.tenant_token}"}
        for i in range(runs):
            body = {"name": f"cold-{i}", "command": [sys.executable, str(MODEL_SERVER)], "gpus": 0.25,
                    "min_replicas": 0, "max_replicas": 1}  # fmt: skip
            created = api.post(f"{stack.url}/api/v1/endpoints/", json=body, timeout=30)
            if created.status_code != 201:
                raise RuntimeError(f"deploy answered {created.status_code}: {created.text[:300]}")
            started = time.perf_counter()
            answer = requests.post(f"http://127.0.0.1:{port}/e/bench/cold-{i}/predict", data=b"x", headers=auth,
                                   timeout=180)  # fmt: skip
            if answer.status_code != 200:
                raise RuntimeError(f"first request answered {answer.status_code}: {answer.text[:300]}")
            samples.append(time.perf_counter() - started)
            api.delete(f"{stack.url}/api/v1/endpoints/{created.json()['id']}/", timeout=30)
    finally:
        stack.stop()
    return {"runs": runs, "seconds": [round(s, 3) for s in samples], "median_s": round(statistics.median(samples), 3),
            "max_s": round(max(samples), 3)}  # fmt: skip


def run(quick: bool = False) -> dict:
    result = asyncio.run(measure(requests=1000 if quick else 5000, concurrency=100))
    result["cold_start"] = cold = cold_start_measured(runs=3 if quick else 5)
    direct, via, cpu = result["direct"], result["gateway"], result["cpu_us_per_request"]
    result["rows"] = [
        {"bench": "gateway", "metric": f"{q} latency at 100 concurrent", "ours": via[f"{q}_ms"], "unit": "ms",
         "reference": direct[f"{q}_ms"], "reference_name": "replica called directly", "higher_is_better": False}
        for q in ("p50", "p99")
    ] + [
        {"bench": "gateway", "metric": f"{label} latency at a fixed {FIXED_RATE} req/s", "ours": fixed["gateway"][q],
         "unit": "ms", "reference": fixed["direct"][q], "reference_name": "replica called directly",
         "higher_is_better": False,
         **({"goal": "added p99 < 5 ms", "goal_met": fixed["gateway"][q] - fixed["direct"][q] < 5} if q == "p99_ms"
            else {}),
         "note": f"added {fixed['gateway'][q] - fixed['direct'][q]:+.2f} ms"}
        for q, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))
        for fixed in [result["fixed_rate"]]
    ] + [
        {"bench": "gateway", "metric": "throughput at 100 concurrent", "goal": ">= 0.8x direct",
         "goal_met": via["rps"] >= 0.8 * direct["rps"], "ours": via["rps"], "unit": "req/s",
         "reference": direct["rps"], "reference_name": "replica called directly"},
        {"bench": "gateway", "metric": "CPU per request, gateway process", "ours": cpu["gateway"], "unit": "us",
         "reference": cpu["replica"], "reference_name": "replica process, same requests", "higher_is_better": False},
        {"bench": "gateway", "metric": "cold start, zero replicas -> first answer (median)", "ours": cold["median_s"],
         "unit": "s", "higher_is_better": False, "runs": cold["runs"], "note": f"max {cold['max_s']} s"},
    ]  # fmt: skip
    return result


def main() -> None:
    if "--serve" in sys.argv:
        at = sys.argv.index("--serve")
        serve_static(int(sys.argv[at + 1]), int(sys.argv[at + 2]))
        return
    if "--cold-start" in sys.argv:
        print(json.dumps(cold_start(runs=int(sys.argv[sys.argv.index("--cold-start") + 1]))))
        return
    result = run(quick="--quick" in sys.argv)
    out = ROOT / "bench" / "results" / "gateway.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
