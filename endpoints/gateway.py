"""The endpoint gateway: ``python -m endpoints.gateway --port 8001``.

Serves ``/e/<tenant>/<endpoint>/<path>``: checks the tenant's API token
(scope ``endpoints:invoke``), forwards each request to the ready replica with
the fewest requests in flight, and streams the answer back chunk by chunk
(token streaming works). A request that finds no ready replica is held in a
bounded queue while one starts (the autoscaler is poked at once), then
answered 503 with ``Retry-After``. A replica that fails before sending a byte
gets the request retried once on another replica; one that breaks off later
does not (it has the request), and a client that goes away is nobody's failure.

The data plane is ``http1.py``'s server (asyncio protocols over httptools'
parser) and ``upstream.py``'s kept-alive connections to the replicas: ~100-130 µs
of CPU a proxied request, where aiohttp's server and client cost ~200-250 µs, as
much as a small replica's own work (docs/benchmarks.md, session 22).
Nothing on the request path touches the database: tokens are checked once per
``TOKEN_CACHE_S``, the routing table and the traffic figures go through
Django's ORM in a thread, in the background. The ops paths (``/healthz``,
``/readyz``, ``/metrics``) are on the same port (``gateway_metrics.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import unquote

from aiohttp import ClientConnectorError, ClientSession, ClientTimeout, ServerDisconnectedError, TCPConnector

from .gateway_metrics import GatewayMetrics, ops_views
from .http1 import Reply, Request, serve
from .upstream import UpstreamBroken, UpstreamFailed, UpstreamPool

log = logging.getLogger("gpushare.gateway")

HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"authorization",
    b"content-length",
}
FORWARD_DROPPED = HOP_BY_HOP | {b"expect"}  # the gateway answers 100-continue itself
MAX_BODY = 10 << 20
TOKEN_CACHE_S = 5.0
FORCED_REFRESH_S = 0.2  # at most this often when a request names an endpoint not in the table
MINUTE_SAMPLE = 5000  # latencies kept per minute (a uniform sample beyond that)
MINUTES_HELD = 60  # finished minutes kept while the platform cannot be told


@dataclass
class Minute:
    """One wall-clock minute of an endpoint's traffic: a row of its request-rate and latency history."""

    start: int  # epoch seconds, a multiple of 60
    requests: int = 0
    errors: int = 0
    peak: int = 0
    seen: int = 0  # latencies observed; ``latencies`` holds a uniform sample of them
    latencies: list = field(default_factory=list)

    def latency(self, ms: float) -> None:
        self.seen += 1
        if len(self.latencies) < MINUTE_SAMPLE:
            self.latencies.append(ms)
        elif (slot := random.randrange(self.seen)) < MINUTE_SAMPLE:
            self.latencies[slot] = ms  # reservoir sampling: every latency equally likely to be kept

    def summary(self) -> dict:
        return {
            "minute": self.start,
            "requests": self.requests,
            "errors": self.errors,
            "peak": self.peak,
            "latency_ms": percentiles(self.latencies),
        }


@dataclass
class Traffic:
    inflight: int = 0
    queued: int = 0
    requests_total: int = 0
    errors_total: int = 0
    last_request_at: float | None = None  # epoch seconds
    window: deque = field(default_factory=deque)  # (monotonic time, concurrency)
    latencies: deque = field(default_factory=lambda: deque(maxlen=2000))  # (monotonic time, ms)
    last_poke: float = 0.0
    minute: Minute | None = None
    finished: deque = field(default_factory=lambda: deque(maxlen=MINUTES_HELD))  # minutes not yet reported

    def this_minute(self, wall: float | None = None) -> Minute:
        start = int((time.time() if wall is None else wall) // 60) * 60
        if self.minute is None or self.minute.start != start:
            if self.minute is not None and (self.minute.requests or self.minute.errors):
                self.finished.append(self.minute)
            self.minute = Minute(start)
        return self.minute

    def minutes_to_report(self) -> list[dict]:
        """The finished minutes not yet reported and the current one (quiet minutes are left out)."""
        current = self.this_minute()
        return [m.summary() for m in (*self.finished, current) if m.requests or m.errors]

    def failed(self) -> None:
        self.errors_total += 1
        self.this_minute().errors += 1

    def note(self, now: float) -> None:
        self.window.append((now, self.inflight + self.queued))

    def peak(self, now: float, horizon_s: float) -> int:
        while self.window and self.window[0][0] < now - horizon_s:
            self.window.popleft()
        return max((c for _, c in self.window), default=0)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


class Gateway:
    def __init__(self, *, refresh_s: float = 0.5, cold_start_timeout_s: float = 60.0, max_queue: int = 100):
        self.refresh_s = refresh_s
        self.cold_start_timeout_s = cold_start_timeout_s
        self.max_queue = max_queue
        self.table: dict = {}
        self.inflight: dict[int, int] = {}
        self.traffic: dict[int, Traffic] = {}
        self.session: ClientSession | None = None  # health checks
        self.upstream = UpstreamPool()  # requests
        self._by_id: tuple[dict, dict[int, object]] = ({}, {})
        self.last_forced_refresh = 0.0
        self.token_cache: dict[tuple[bytes, str], tuple[float, tuple | None]] = {}
        self.changed = asyncio.Event()
        self.metrics = GatewayMetrics(self)  # requests, errors, latency, in flight, replicas
        self.ops = ops_views(self)  # /healthz, /readyz, /metrics
        self.server: asyncio.Server | None = None
        self._background: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> asyncio.Server:
        """Listen on ``host``:``port`` (0: any free port) and keep the routing table fresh; ``stop`` undoes it."""
        # Health checks only; requests go through self.upstream (kept-alive connections, no cap).
        self.session = ClientSession(auto_decompress=False, connector=TCPConnector(limit=0, keepalive_timeout=60))
        self._background = asyncio.create_task(self.background())
        self.server = await serve(self.dispatch, host, port, max_body=MAX_BODY)
        return self.server

    async def stop(self) -> None:
        self.server.close()
        self._background.cancel()
        await self.session.close()
        await self.upstream.close()

    # --- platform state (Django, in a thread) ---------------------------------

    async def refresh(self) -> None:
        from asgiref.sync import sync_to_async

        from .selectors import routing_table

        self.table = await sync_to_async(routing_table, thread_sensitive=False)()
        self.upstream.keep_only({(r.address, r.port) for route in self.table.values() for r in route.replicas})
        self.changed.set()
        self.changed = asyncio.Event()

    async def health_check(self) -> None:
        from asgiref.sync import sync_to_async

        from .services import replica_ready_set

        checks = []
        for route in self.table.values():
            for replica in route.replicas:
                if replica.state in ("starting", "ready"):
                    checks.append((replica, route.health_path))

        async def check(replica, path):
            try:
                async with self.session.get(
                    f"http://{replica.address}:{replica.port}{path}", timeout=ClientTimeout(total=1)
                ) as resp:
                    ok = resp.status < 500
            except (TimeoutError, OSError, ClientConnectorError, ServerDisconnectedError):
                ok = False
            except Exception as exc:  # noqa: BLE001 - a broken replica must not stop the checks
                log.debug("health check of replica %s: %s", replica.replica_id, exc)
                ok = False
            if ok != (replica.state == "ready"):
                await sync_to_async(replica_ready_set, thread_sensitive=False)(replica_id=replica.replica_id, ready=ok)

        await asyncio.gather(*(check(r, p) for r, p in checks))

    async def report(self) -> None:
        from asgiref.sync import sync_to_async

        from .services import endpoint_load_record

        now = time.monotonic()
        for route in self.table.values():
            t = self.traffic.setdefault(route.endpoint_id, Traffic())
            t.note(now)
            horizon = route.idle_timeout_s
            recent = [ms for at, ms in t.latencies if at >= now - 60]
            stats = {
                "inflight": t.inflight,
                "queued": t.queued,
                "peak": t.peak(now, horizon),
                "requests_total": t.requests_total,
                "errors_total": t.errors_total,
                "last_request_at": datetime.fromtimestamp(t.last_request_at, UTC) if t.last_request_at else None,
                "replica_inflight": {r.replica_id: self.inflight.get(r.replica_id, 0) for r in route.replicas},
                "latency_ms": percentiles(recent),
                "minutes": t.minutes_to_report(),
            }
            reported = len(t.finished)  # more may finish while the platform is being told
            await sync_to_async(endpoint_load_record, thread_sensitive=False)(
                endpoint_id=route.endpoint_id, stats=stats
            )
            for _ in range(min(reported, len(t.finished))):
                t.finished.popleft()

    async def poke_autoscaler(self, endpoint_id: int) -> None:
        from asgiref.sync import sync_to_async

        from .services import endpoint_autoscale

        t = self.traffic.setdefault(endpoint_id, Traffic())
        if time.monotonic() - t.last_poke < 1.0:
            return
        t.last_poke = time.monotonic()
        await self.report()
        await sync_to_async(endpoint_autoscale, thread_sensitive=False)(endpoint_id=endpoint_id)

    async def background(self) -> None:
        ticks = 0
        while True:
            try:
                await self.refresh()
                await self.health_check()
                if ticks % max(1, int(1 / self.refresh_s)) == 0:
                    await self.report()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway refresh failed")
            ticks += 1
            await asyncio.sleep(self.refresh_s)

    async def principal(self, plaintext: str, tenant_slug: str):
        """Check a token (cached for TOKEN_CACHE_S: a revocation takes effect within that)."""
        from asgiref.sync import sync_to_async

        key = (hashlib.sha256(plaintext.encode()).digest(), tenant_slug)
        cached = self.token_cache.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        problem = await sync_to_async(token_check, thread_sensitive=False)(plaintext, tenant_slug)
        if len(self.token_cache) > 10_000:
            self.token_cache.clear()
        self.token_cache[key] = (now + TOKEN_CACHE_S, problem)
        return problem

    def route_of(self, endpoint_id: int):
        """The endpoint's entry in the routing table (indexed once per refresh, not scanned per request)."""
        table, by_id = self._by_id
        if table is not self.table:
            by_id = {route.endpoint_id: route for route in self.table.values()}
            self._by_id = (self.table, by_id)
        return by_id.get(endpoint_id)

    def pick(self, route, exclude: set[int]):
        """The ready replica with the fewest requests in flight, of the newest version that has one."""
        ready = [r for r in route.replicas if r.state == "ready" and r.replica_id not in exclude]
        if not ready:
            return None
        newest = max(r.version for r in ready)
        ready = [r for r in ready if r.version == newest]
        low = min(self.inflight.get(r.replica_id, 0) for r in ready)
        return random.choice([r for r in ready if self.inflight.get(r.replica_id, 0) == low])

    # --- requests --------------------------------------------------------------

    async def dispatch(self, request: Request, reply: Reply) -> None:
        """The server's handler: ``/e/<tenant>/<endpoint>[/<path>]``, the ops paths, else 404."""
        path = request.path
        if path.startswith(b"/e/"):
            parts = path.split(b"/", 4)  # b"", b"e", tenant, endpoint, the replica's path
            if len(parts) >= 4 and parts[2] and parts[3]:
                await self.metered(request, reply, segment(parts[2]), segment(parts[3]))
                return
        elif (view := self.ops.get(path)) is not None:
            if request.method not in (b"GET", b"HEAD"):
                send_error(reply, 405, "method_not_allowed", "only GET and HEAD here")
                return
            await view(request, reply)
            return
        send_error(reply, 404, "not_found", "Not found.")

    async def metered(self, request: Request, reply: Reply, tenant: str, name: str) -> None:
        """``handle`` with its request counted, timed and in flight in the gateway's Prometheus series."""
        metrics = self.metrics
        labels = metrics.labels_for(tenant, name)
        inflight, latency = metrics.series_of(labels)
        inflight.inc()
        started = time.monotonic()
        code = 500
        try:
            await self.handle(request, reply, tenant, name)
            code = reply.status
        except (asyncio.CancelledError, ConnectionResetError):
            code = 499  # the client went away (nginx's code): not the gateway's error
            raise
        finally:
            inflight.dec()
            found = metrics.labels_for(tenant, name)  # a route found by this very request's refresh
            if found != labels:
                labels, (_, latency) = found, metrics.series_of(found)  # in flight counted under the first
            metrics.count(labels, code)
            latency.observe(time.monotonic() - started)

    async def handle(self, request: Request, reply: Reply, tenant: str, name: str) -> None:
        auth = request.header(b"authorization") or b""
        if not auth.startswith(b"Bearer "):
            send_error(reply, 401, "unauthenticated", "send 'Authorization: Bearer <token>' (scope endpoints:invoke)")
            return
        problem = await self.principal(auth[7:].strip().decode("latin-1"), tenant)
        if problem is not None:
            send_error(reply, *problem)
            return
        route = self.table.get((tenant, name))
        if route is None and time.monotonic() - self.last_forced_refresh > FORCED_REFRESH_S:
            # Maybe deployed since the last refresh: look once more before saying 404.
            self.last_forced_refresh = time.monotonic()
            await self.refresh()
            route = self.table.get((tenant, name))
        if route is None:
            send_error(reply, 404, "not_found", "Not found.")
            return
        t = self.traffic.setdefault(route.endpoint_id, Traffic())
        t.requests_total += 1
        t.last_request_at = time.time()
        minute = t.this_minute()
        minute.requests += 1
        minute.peak = max(minute.peak, t.inflight + t.queued + 1)
        started = time.monotonic()
        tried: set[int] = set()
        for attempt in range(2):
            replica = await self.wait_for_replica(route.endpoint_id, t, tried)
            if replica is None:
                t.failed()
                if no_capacity(self.route_of(route.endpoint_id) or route):
                    send_error(reply, 503, "unavailable", "no replica is ready and there is no capacity to start "
                               "one now; retry later", retry_after=30)  # fmt: skip
                else:
                    send_error(reply, 503, "unavailable", "no replica is ready yet; retry shortly", retry_after=5)
                return
            tried.add(replica.replica_id)
            self.inflight[replica.replica_id] = self.inflight.get(replica.replica_id, 0) + 1
            t.inflight += 1
            try:
                whole = await self.forward(request, reply, replica)
            except UpstreamFailed as exc:
                log.info("replica %s failed before answering (%s); attempt %d", replica.replica_id, exc, attempt + 1)
                continue
            except UpstreamBroken as exc:  # the replica has the request: not tried again
                log.warning("replica %s broke off its answer: %s", replica.replica_id, exc)
                t.failed()
                send_error(reply, 502, "bad_gateway", "the replica's answer broke off", retry_after=1)
                return
            finally:
                self.inflight[replica.replica_id] -= 1
                t.inflight -= 1
            if not whole:
                t.failed()
            now = time.monotonic()
            elapsed_ms = (now - started) * 1000
            t.latencies.append((now, elapsed_ms))
            t.this_minute().latency(elapsed_ms)
            return
        t.failed()
        send_error(reply, 502, "bad_gateway", "the replicas failed to answer", retry_after=1)

    async def wait_for_replica(self, endpoint_id: int, t: Traffic, tried: set[int]):
        deadline = time.monotonic() + self.cold_start_timeout_s
        queued = False
        try:
            while True:
                route = self.route_of(endpoint_id)
                replica = self.pick(route, tried) if route else None
                if replica is not None or route is None:
                    return replica
                if no_capacity(route):
                    return None  # nothing will be ready soon: 503 with Retry-After now, not after the hold
                if not queued:
                    if t.queued >= self.max_queue:
                        return None
                    t.queued += 1
                    queued = True
                    await self.poke_autoscaler(endpoint_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 1.0))
                except TimeoutError:
                    await self.poke_autoscaler(endpoint_id)
        finally:
            if queued:
                t.queued -= 1

    async def forward(self, request: Request, reply: Reply, replica) -> bool:
        """Whether the replica's answer reached the client whole. Raises UpstreamFailed (nothing answered:
        may be retried) or UpstreamBroken (broke off before the client got a byte). An answer that breaks
        off while streaming closes the client's connection, so it cannot pass for a whole one."""
        sent = upstream_request(request, replica)
        async with self.upstream.exchange(replica.address, replica.port, sent) as answer:
            headers = [(k, v) for k, v in answer.headers if k.lower() not in HOP_BY_HOP]
            if answer.whole:
                reply.send(answer.status, headers, await answer.read())
                return True
            reply.start(answer.status, headers, answer.length if answer.framing == "length" else None)
            try:
                async for chunk in answer.body():
                    await reply.write(chunk)
            except UpstreamBroken as exc:
                log.warning("replica %s broke off a streamed answer: %s", replica.replica_id, exc)
                reply.abort()
                return False
            reply.finish()
            return True


def segment(raw: bytes) -> str:
    """A tenant's or endpoint's name from the path, percent-decoded."""
    return unquote(raw.decode("latin-1")) if b"%" in raw else raw.decode("latin-1")


def upstream_request(request: Request, replica) -> bytes:
    """The client's request as the replica gets it, in HTTP/1.1 bytes: the path after
    ``/e/<tenant>/<endpoint>`` and the query as sent, the end-to-end headers, the body."""
    path, mark, query = request.target.partition(b"?")
    parts = path.split(b"/", 4)
    head = bytearray(
        b"%s /%s%s%s HTTP/1.1\r\nHost: %s:%d\r\n"
        % (request.method, parts[4] if len(parts) > 4 else b"", mark, query, replica.address.encode(), replica.port)
    )
    for name, value in request.headers:
        if name.lower() not in FORWARD_DROPPED:
            head += b"%s: %s\r\n" % (name, value)
    body = request.body
    if body or request.method in (b"POST", b"PUT", b"PATCH"):
        head += b"Content-Length: %d\r\n" % len(body)
    head += b"\r\n"
    head += body
    return bytes(head)


def no_capacity(route) -> bool:
    """No replica can be ready soon: none may run (max 0), or a pass could not place one (no capacity)
    and none is starting on a node. A cold start (a replica placed and starting, or just asked for
    and not yet seen by a pass) is held instead."""
    if route.max_replicas == 0:
        return True
    starting = any(r.state == "starting" for r in route.replicas)
    return bool(route.unplaceable) and not starting


def token_check(plaintext: str, tenant_slug: str) -> tuple | None:
    """None if the token may invoke the tenant's endpoints, else (status, code, message)."""
    from accounts.authentication import TokenRejected, token_principal

    try:
        principal = token_principal(plaintext).principal
    except TokenRejected as exc:
        return 401, "unauthenticated", str(exc)
    if principal.tenant.slug != tenant_slug:
        return 404, "not_found", "Not found."
    if "endpoints:invoke" not in principal.scopes:
        return 403, "forbidden", "this token lacks the 'endpoints:invoke' scope"
    return None


def send_error(reply: Reply, status: int, code: str, message: str, *, retry_after: int | None = None) -> None:
    """An answer in the API's error shape."""
    headers = [(b"Content-Type", b"application/json; charset=utf-8")]
    if retry_after:
        headers.append((b"Retry-After", b"%d" % retry_after))
    reply.send(status, headers, json.dumps({"error": {"code": code, "message": message, "fields": {}}}).encode())


async def run(gateway: Gateway, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then stop taking requests and let the background work go."""
    await gateway.start(host, port)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await gateway.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpushare-gateway")
    parser.add_argument("--host", default=os.environ.get("GATEWAY_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GATEWAY_PORT", "8001")))
    parser.add_argument("--cold-start-timeout", type=float, default=60.0)
    parser.add_argument("--refresh", type=float, default=0.5)
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    import django

    django.setup()  # also configures logging from settings.LOGGING: JSON lines in production
    gateway = Gateway(refresh_s=args.refresh, cold_start_timeout_s=args.cold_start_timeout)
    serve_forever(run(gateway, args.host, args.port))


def serve_forever(coroutine) -> None:
    """Run the gateway's loop: uvloop's when installed (requirements.txt), cheaper per request than asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


if __name__ == "__main__":
    main()
