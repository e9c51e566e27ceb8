"""Gateway overhead: p50/p99 added latency of the endpoint gateway against
calling a replica directly, at 100 concurrent requests.

    python -m bench.endpoints_gateway [--quick]

The replica is tests/endpoints/model_server.py (answers at once); the gateway
is the real aiohttp app (endpoints.gateway) with its routing table and token
check fixed in memory, so the figure is the proxy path itself: routing,
least-outstanding choice, forwarding and streaming the answer back. Cold
start (zero replicas to first answer) needs the whole platform and is
measured by tests/endpoints/test_endpoints_integration.py, which prints it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import ClientError, ClientSession, TCPConnector, web

ROOT = Path(__file__).resolve().parent.parent
MODEL_SERVER = ROOT / "tests" / "endpoints" / "model_server.py"


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


async def measure(*, requests: int, concurrency: int) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    import django

    django.setup()
    from endpoints import gateway as gw
    from endpoints.selectors import EndpointRoute, Route

    replica_port, gateway_port = free_port(), free_port()
    replica = subprocess.Popen(
        [sys.executable, str(MODEL_SERVER)], env={**os.environ, "PORT": str(replica_port), "SLEEP_S": "0"}
    )
    try:
        route = EndpointRoute(
            1, 1, "bench", "echo", "/health", 1, 60, (Route(1, "127.0.0.1", replica_port, "ready", 1),)
        )

        class StaticGateway(gw.Gateway):
            async def refresh(self):
                self.table = {("bench", "echo"): route}

            async def health_check(self):
                pass

            async def report(self):
                pass

            async def principal(self, plaintext, tenant_slug):
                return None

        app = gw.make_app(StaticGateway(refresh_s=1.0))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", gateway_port).start()
        await asyncio.sleep(1.0)
        headers = {"Authorization": "Bearer bench"}
        direct_url = f"http://127.0.0.1:{replica_port}/predict"
        via_url = f"http://127.0.0.1:{gateway_port}/e/bench/echo/predict"
        await load(direct_url, requests=200, concurrency=concurrency, headers=headers)  # warm up
        runs = []
        for _ in range(3):
            direct = await load(direct_url, requests=requests, concurrency=concurrency, headers=headers)
            via = await load(via_url, requests=requests, concurrency=concurrency, headers=headers)
            runs.append((direct, via))
        await runner.cleanup()
    finally:
        replica.terminate()
        replica.wait(timeout=10)
    median = sorted(runs, key=lambda r: r[1]["p50_ms"] - r[0]["p50_ms"])[len(runs) // 2]
    direct, via = median
    return {
        "concurrency": concurrency,
        "requests": requests,
        "direct": direct,
        "gateway": via,
        "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 2),
        "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 2),
    }


def run(quick: bool = False) -> dict:
    result = asyncio.run(measure(requests=1000 if quick else 5000, concurrency=100))
    direct, via = result["direct"], result["gateway"]
    result["rows"] = [
        {"bench": "gateway", "metric": f"{q} latency at 100 concurrent", "ours": via[f"{q}_ms"], "unit": "ms",
         "reference": direct[f"{q}_ms"], "reference_name": "replica called directly", "higher_is_better": False}
        for q in ("p50", "p99")
    ] + [
        {"bench": "gateway", "metric": "throughput at 100 concurrent", "ours": via["rps"], "unit": "req/s",
         "reference": direct["rps"], "reference_name": "replica called directly"},
    ]  # fmt: skip
    return result


def main() -> None:
    result = run(quick="--quick" in sys.argv)
    out = ROOT / "bench" / "results" / "gateway.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
