"""An open-loop load generator: requests at a fixed rate, whatever the server's answers do.

A closed loop (wrk, or N clients each waiting for its answer) slows down when
the server does and so hides queueing: that is "coordinated omission". Here
request ``i`` is due at ``start + i / rate`` and its latency is measured from
that due time, not from when it was actually sent, so a stall counts against
every request that should have gone out during it (what wrk2 does).
Persistent connections (a pool of up to ``connections``), uvloop when
installed. Used by the api and gateway benchmarks:

    fixed_rate(url, rate=100, seconds=20, method="GET", headers=..., body=None) -> dict
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from .stats import percentile


async def _run(url: str, *, rate: float, seconds: float, method: str, headers: dict, body, connections: int) -> dict:
    total = int(rate * seconds)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0
    data = json.dumps(body).encode() if body is not None else None
    headers = {**headers, **({"Content-Type": "application/json"} if data is not None else {})}
    connector = TCPConnector(limit=connections, keepalive_timeout=60)
    async with ClientSession(connector=connector, timeout=ClientTimeout(total=30)) as session:

        async def one(due: float) -> None:
            nonlocal errors
            try:
                async with session.request(method, url, data=data, headers=headers) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
            except (ClientError, TimeoutError):
                errors += 1
                return
            latencies.append((time.perf_counter() - due) * 1000)

        loop = asyncio.get_running_loop()
        tasks = []
        start = time.perf_counter() + 0.05
        for i in range(total):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(due)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    out = {"rate": rate, "seconds": seconds, "sent": total, "ok": ok, "errors": errors + total - ok,
           "statuses": statuses, "achieved_rps": round(total / elapsed, 1)}  # fmt: skip
    if latencies:
        for name, q in (("p50_ms", 50), ("p99_ms", 99), ("p999_ms", 99.9)):
            out[name] = round(percentile(latencies, q), 2)
        out["max_ms"] = round(max(latencies), 2)
    return out


def fixed_rate(url: str, *, rate: float, seconds: float, method: str = "GET", headers: dict | None = None,
               body=None, connections: int = 256) -> dict:  # fmt: skip
    """Send ``rate`` requests per second for ``seconds``; latency percentiles from each request's due time."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(_run(url, rate=rate, seconds=seconds, method=method, headers=headers or {}, body=body,
                       connections=connections))  # fmt: skip
