"""The gateway's request path against real sockets, in one event loop: the routing table and the token
check are fixed in memory (as in bench/endpoints_gateway.py), the replicas are small servers that
count what they were sent. Which failures are retried on another replica, what a client that leaves
does to the replica, kept-alive upstream connections, streaming, and the path and query as sent."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import ClientSession, web

from endpoints import gateway as gw
from endpoints.selectors import EndpointRoute, Route
from endpoints.upstream import UpstreamPool

AUTH = {"Authorization": "Bearer test"}


class StaticGateway(gw.Gateway):
    """The real request path with the platform (database, autoscaler) left out."""

    def __init__(self, replica_ports: list[int]):
        super().__init__(refresh_s=60, cold_start_timeout_s=1)
        replicas = tuple(Route(i, "127.0.0.1", port, "ready", 1) for i, port in enumerate(replica_ports, 1))
        self.table = {("t", "e"): EndpointRoute(1, 1, "t", "e", "/health", 1, 60, replicas, len(replicas))}

    async def refresh(self):
        pass

    async def health_check(self):
        pass

    async def report(self):
        pass

    async def poke_autoscaler(self, endpoint_id):
        pass

    async def principal(self, plaintext, tenant_slug):
        return None


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class Replica:
    """An aiohttp replica that records each request's target and the connection it came on."""

    def __init__(self):
        self.seen: list[str] = []
        self.connections: set = set()
        self.app = web.Application()
        self.app.router.add_route("*", "/stream", self.stream)
        self.app.router.add_route("*", "/{tail:.*}", self.echo)

    async def echo(self, request):
        self.seen.append(request.path_qs)
        self.connections.add(request.transport.get_extra_info("peername"))
        return web.json_response({"target": request.raw_path, "body": (await request.read()).decode()})

    async def stream(self, request):
        self.seen.append(request.path_qs)
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(3):
            await response.write(f"token{i}\n".encode())
            await asyncio.sleep(0.3)
        await response.write_eof()
        return response


async def raw_replica(answer: bytes | None, seen: list) -> tuple[asyncio.Server, int]:
    """A replica that reads a request head, writes ``answer`` (or nothing) and closes the connection."""

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b"\r\n", 1)[0])
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def with_gateway(ports: list[int], body):
    gateway = StaticGateway(ports)
    server = await gateway.start("127.0.0.1", 0)
    try:
        async with ClientSession() as client:
            return await body(client, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/e/t/e", gateway)
    finally:
        await gateway.stop()


def run_apart(coroutine):
    """``asyncio.run`` in a thread of its own: the browser tests' session-wide Playwright keeps an event
    loop running in the main thread, where ``asyncio.run`` refuses to start another."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def test_the_path_and_query_reach_the_replica_as_sent_on_one_kept_alive_connection():
    replica = Replica()

    async def scenario():
        runner, port = await serve(replica.app)

        async def body(client, base, gateway):
            targets = []
            for suffix in ("/a/b?x=1&y=%20z", "?q=1", "", "/predict"):
                async with client.post(base + suffix, data=b"hello", headers=AUTH) as answer:
                    assert answer.status == 200
                    got = await answer.json()
                    assert got["body"] == "hello"
                    targets.append(got["target"])
            return targets

        try:
            return await with_gateway([port], body)
        finally:
            await runner.cleanup()

    assert run_apart(scenario()) == ["/a/b?x=1&y=%20z", "/?q=1", "/", "/predict"]
    assert len(replica.connections) == 1  # one upstream connection carried all four requests


def test_a_replica_that_closes_before_answering_gets_the_request_retried_on_another():
    replica, seen = Replica(), []

    async def scenario():
        closing, closing_port = await raw_replica(None, seen)
        runner, port = await serve(replica.app)

        async def body(client, base, gateway):
            statuses = []
            for _ in range(4):  # least-outstanding with ties broken at random: both are tried first sometimes
                async with client.post(base + "/predict", data=b"x", headers=AUTH) as answer:
                    statuses.append(answer.status)
            return statuses

        try:
            return await with_gateway([closing_port, port], body)
        finally:
            await runner.cleanup()
            closing.close()

    assert run_apart(scenario()) == [200] * 4
    assert len(replica.seen) == 4


def test_an_answer_that_breaks_off_is_502_and_not_sent_to_another_replica():
    seen: list = []
    broken = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b"

    async def scenario():
        servers = [await raw_replica(broken, seen) for _ in range(2)]

        async def body(client, base, gateway):
            async with client.post(base + "/predict", data=b"x", headers=AUTH) as answer:
                return answer.status, (await answer.json())["error"]["code"], gateway.traffic[1].errors_total

        try:
            return await with_gateway([port for _, port in servers], body)
        finally:
            for server, _ in servers:
                server.close()

    assert run_apart(scenario()) == (502, "bad_gateway", 1)
    assert len(seen) == 1  # the replica had the request: it is not sent again


def test_a_client_that_leaves_mid_stream_is_not_retried_nor_counted_against_the_replica():
    replica = Replica()

    async def scenario():
        runners = [await serve(replica.app) for _ in range(2)]

        async def body(client, base, gateway):
            started = time.monotonic()
            async with client.get(base + "/stream", headers=AUTH) as answer:
                first = await answer.content.readline()
                first_at = time.monotonic() - started
                answer.connection.transport.abort()  # the client goes away after the first token
            await asyncio.sleep(1.5)  # the rest of the stream, and a retry's hold if there were one
            return first, first_at, gateway.traffic[1]

        try:
            return await with_gateway([port for _, port in runners], body)
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    first, first_at, traffic = run_apart(scenario())
    assert first == b"token0\n" and first_at < 0.25  # streamed: the first token before the replica finished
    assert replica.seen == ["/stream"]  # not sent to the other replica
    assert traffic.errors_total == 0 and traffic.inflight == 0 and traffic.queued == 0


def test_a_kept_alive_connection_the_replica_closed_while_idle_is_replaced():
    seen: list = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"  # keep-alive by default, then closed anyway

    async def scenario():
        server, port = await raw_replica(answer, seen)

        async def body(client, base, gateway):
            statuses = []
            for _ in range(5):
                async with client.post(base + "/predict", data=b"x", headers=AUTH) as reply:
                    statuses.append((reply.status, await reply.read()))
                await asyncio.sleep(0.05)
            return statuses

        try:
            return await with_gateway([port], body)
        finally:
            server.close()

    assert run_apart(scenario()) == [(200, b"ok")] * 5
    assert len(seen) == 5


def test_idle_connections_to_a_replica_that_left_the_table_are_closed():
    replica = Replica()

    async def scenario():
        runner, port = await serve(replica.app)
        pool = UpstreamPool()
        try:
            request = b"GET /x HTTP/1.1\r\nHost: r\r\n\r\n"
            async with pool.exchange("127.0.0.1", port, request) as answer:
                assert answer.status == 200 and await answer.read()
            (kept,) = pool.idle[("127.0.0.1", port)]
            pool.keep_only({("127.0.0.1", port)})
            assert pool.idle[("127.0.0.1", port)] == [kept]
            pool.keep_only(set())
            return pool.idle, kept.transport.is_closing()
        finally:
            await pool.close()
            await runner.cleanup()

    assert run_apart(scenario()) == ({}, True)
