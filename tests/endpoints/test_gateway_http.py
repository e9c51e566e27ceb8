"""The gateway's HTTP/1.1 on the wire (endpoints/http1.py, endpoints/upstream.py), spoken byte by byte
over real sockets: pipelining, limits, bad requests, 100-continue, HEAD, HTTP/1.0 clients, clients that
leave, and the answers replicas send (chunked, close-delimited, interim, not HTTP at all)."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace

from aiohttp import web

from endpoints import gateway as gw
from endpoints.http1 import serve
from tests.endpoints.test_gateway_proxy import Replica, StaticGateway, raw_replica, run_apart
from tests.endpoints.test_gateway_proxy import serve as serve_aiohttp

AUTH = b"Authorization: Bearer test\r\n"


async def read_answer(reader: asyncio.StreamReader, *, head_only: bool = False) -> tuple[int, dict, bytes]:
    """(status, headers by lower-case name, body) of one answer, framed as its headers say."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    status = int(status_line.split(" ")[1])
    if head_only or status in (100, 204, 304):
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
        return status, headers, body
    return status, headers, await reader.read()


async def gateway_for(ports: list[int], **kwargs) -> tuple[StaticGateway, int]:
    gateway = StaticGateway(ports)
    for name, value in kwargs.items():
        setattr(gateway, name, value)
    server = await gateway.start("127.0.0.1", 0)
    return gateway, server.sockets[0].getsockname()[1]


async def with_echo(scenario):
    """``scenario(port, gateway, replica)`` against a gateway in front of one echoing replica."""
    replica = Replica()
    runner, replica_port = await serve_aiohttp(replica.app)
    gateway, port = await gateway_for([replica_port])
    try:
        return await scenario(port, gateway, replica)
    finally:
        await gateway.stop()
        await runner.cleanup()


def test_pipelined_requests_are_answered_in_order_on_one_connection():
    """The first request is the slowest to answer: answers must still come back in the order asked."""

    async def slow_echo(request):
        wait_ms = int(request.match_info["ms"])
        await asyncio.sleep(wait_ms / 1000)
        return web.json_response({"waited": wait_ms, "body": (await request.read()).decode()})

    async def scenario():
        app = web.Application()
        app.router.add_post("/{ms}", slow_echo)
        runner, replica_port = await serve_aiohttp(app)
        gateway, port = await gateway_for([replica_port])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(b"POST /e/t/e/%d HTTP/1.1\r\nHost: g\r\n%sContent-Length: 1\r\n\r\n%d"
                                  % (200 - 50 * i, AUTH, i) for i in range(4)))  # fmt: skip
            answers = [await read_answer(reader) for _ in range(4)]
            writer.close()
            return [(status, json.loads(body)) for status, _, body in answers]
        finally:
            await gateway.stop()
            await runner.cleanup()

    answers = run_apart(scenario())
    assert answers == [(200, {"waited": 200 - 50 * i, "body": str(i)}) for i in range(4)]


def test_a_body_over_the_limit_is_413_in_the_error_shape_and_never_forwarded():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e/t/e/x HTTP/1.1\r\nHost: g\r\n%sContent-Length: %d\r\n\r\n" % (AUTH, gw.MAX_BODY + 1))
        status, headers, body = await read_answer(reader)
        closed = await reader.read() == b""
        writer.close()
        return status, headers.get("connection"), json.loads(body)["error"], closed, replica.seen

    status, connection, error, closed, seen = run_apart(with_echo(scenario))
    assert (status, connection, error["code"], closed, seen) == (413, "close", "too_large", True, [])
    assert str(gw.MAX_BODY) in error["message"]


def test_a_chunked_body_that_grows_over_the_limit_is_413():
    async def handler(request, reply):
        reply.send(200, [], request.body)

    async def scenario():
        server = await serve(handler, "127.0.0.1", 0, max_body=10)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n12345678\r\n")
        await asyncio.sleep(0.05)
        writer.write(b"8\r\n12345678\r\n0\r\n\r\n")
        answer = await read_answer(reader)
        writer.close()
        server.close()
        return answer[0], json.loads(answer[2])["error"]["code"]

    assert run_apart(scenario()) == (413, "too_large")


def test_bad_http_is_400_in_the_error_shape():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"THIS IS NOT HTTP\r\n\r\n")
        status, _, body = await read_answer(reader)
        writer.close()
        return status, json.loads(body)["error"]["code"]

    assert run_apart(with_echo(scenario)) == (400, "bad_request")


def test_expect_100_continue_is_answered_by_the_gateway_and_not_forwarded():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e/t/e/p HTTP/1.1\r\nHost: g\r\n%sExpect: 100-continue\r\nContent-Length: 5\r\n\r\n" % AUTH)
        interim = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"hello")
        status, _, body = await read_answer(reader)
        writer.close()
        return interim, status, json.loads(body)

    interim, status, body = run_apart(with_echo(scenario))
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert (status, body) == (200, {"target": "/p", "body": "hello"})


def test_head_gets_the_head_alone_and_the_connection_serves_on():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /e/t/e/h HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH)
        head_status, _, _ = await read_answer(reader, head_only=True)
        writer.write(b"GET /e/t/e/g HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH)
        status, _, body = await read_answer(reader)  # would read the HEAD's body bytes, had any been sent
        writer.close()
        return head_status, status, json.loads(body)["target"]

    assert run_apart(with_echo(scenario)) == (200, 200, "/g")


def test_an_http_1_0_client_gets_its_answer_and_a_close():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /e/t/e/old HTTP/1.0\r\n%s\r\n" % AUTH)
        status, headers, body = await read_answer(reader)
        closed = await reader.read() == b""
        writer.close()
        return status, headers.get("connection"), json.loads(body)["target"], closed

    assert run_apart(with_echo(scenario)) == (200, "close", "/old", True)


def test_a_client_that_leaves_while_its_request_is_held_lets_it_go():
    """No replica is ready (one is starting): the request is held; the client leaves; the hold ends then,
    not at the cold-start timeout, and the request is counted as the client's going (499), not an error."""

    async def scenario():
        gateway, port = await gateway_for([1])
        gateway.cold_start_timeout_s = 30
        route = gateway.table[("t", "e")]
        gateway.table = {("t", "e"): replace(route, replicas=(replace(route.replicas[0], state="starting"),))}
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /e/t/e/x HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH)
            await asyncio.sleep(0.3)
            held = gateway.traffic[1].queued
            writer.transport.abort()
            await asyncio.sleep(0.3)
            traffic = gateway.traffic[1]
            left = gateway.metrics.requests.labels("t", "e", "499")._value.get()
            return held, traffic.queued, traffic.inflight, traffic.errors_total, left
        finally:
            await gateway.stop()

    assert run_apart(scenario()) == (1, 0, 0, 0, 1)


async def served_once(handler) -> tuple[int, str, bool]:
    """(status, error code, connection closed after) of one GET answered by ``handler`` on a bare server."""
    server = await serve(handler, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(b"GET / HTTP/1.1\r\nHost: g\r\n\r\n")
    status, _, body = await read_answer(reader)
    closed = await reader.read() == b""
    writer.close()
    server.close()
    return status, json.loads(body)["error"]["code"], closed


def test_a_handler_that_fails_is_500_in_the_error_shape_and_the_connection_closed():
    async def handler(request, reply):
        raise RuntimeError("boom")

    assert run_apart(served_once(handler)) == (500, "server_error", True)


def test_the_ops_paths_answer_get_and_refuse_other_methods_and_unknown_paths_are_404():
    async def scenario(port, gateway, replica):
        answers = []
        for request in (b"GET /healthz", b"POST /healthz", b"GET /nope", b"GET /e/t", b"GET /e//x"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request + b" HTTP/1.1\r\nHost: g\r\nContent-Length: 0\r\n\r\n")
            status, _, body = await read_answer(reader)
            answers.append((status, json.loads(body)))
            writer.close()
        return answers

    healthz, post, nope, short, empty = run_apart(with_echo(scenario))
    assert healthz == (200, {"ok": True, "endpoints": 1})
    assert post[0] == 405 and post[1]["error"]["code"] == "method_not_allowed"
    assert [nope[0], short[0], empty[0]] == [404, 404, 404]


async def through_raw_replica(answer: bytes, request: bytes = b"GET /e/t/e/x HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH):
    """What a client gets through the gateway from a replica that writes ``answer`` and closes."""
    seen: list = []
    server, replica_port = await raw_replica(answer, seen)
    gateway, port = await gateway_for([replica_port])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        got = await read_answer(reader)
        writer.close()
        return got, gateway.traffic[1].errors_total, len(seen)
    finally:
        await gateway.stop()
        server.close()


def test_replica_answers_in_each_framing_reach_the_client_whole():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    closing = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the close"
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\nX-Kept: yes\r\n\r\nok"
    empty = b"HTTP/1.1 204 No Content\r\nX-Kept: yes\r\n\r\n"
    answers = {"chunked": chunked, "closing": closing, "interim": interim, "empty": empty}
    results = {name: run_apart(through_raw_replica(answer)) for name, answer in answers.items()}
    assert results["chunked"][0][0] == 200 and results["chunked"][0][2] == b"hello world"
    assert results["closing"][0][0] == 200 and results["closing"][0][2] == b"until the close"
    assert results["interim"][0][0] == 201 and results["interim"][0][2] == b"ok"
    assert results["interim"][0][1]["x-kept"] == "yes"
    assert results["empty"][0][0] == 204 and results["empty"][0][1]["x-kept"] == "yes"
    assert all(errors == 0 and tried == 1 for _, errors, tried in results.values())


def test_an_answer_that_is_not_http_is_502_and_not_sent_again():
    (status, _, body), errors, tried = run_apart(through_raw_replica(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"))
    assert (status, json.loads(body)["error"]["code"], errors, tried) == (502, "bad_gateway", 1, 1)
    (status, _, body), errors, tried = run_apart(
        through_raw_replica(b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\nxx")
    )
    assert (status, errors, tried) == (502, 1, 1)


def test_a_large_streamed_answer_reaches_a_slow_client_intact():
    """16 MiB streamed by the replica (more than the sockets' buffers on the way and the 256 KiB the gateway
    holds) to a client that reads nothing for a while: the replica is paused rather than the gateway's
    memory filled, and every byte arrives."""
    payload = bytes(range(256)) * (16 << 12)

    async def scenario():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for at in range(0, len(payload), 64 << 10):
                piece = payload[at : at + (64 << 10)]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        gateway, port = await gateway_for([server.sockets[0].getsockname()[1]])
        try:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"GET /e/t/e/big HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH)
            await asyncio.sleep(1.0)  # the client reads nothing for a while
            (connection,) = gateway.upstream.busy
            paused, held = connection.paused, connection.answer.held_bytes
            status, _, body = await read_answer(reader)
            writer.close()
            return status, body == payload, paused, held
        finally:
            await gateway.stop()
            server.close()

    status, whole, paused, held = run_apart(scenario())
    assert (status, whole, paused) == (200, True, True)
    assert held <= (256 << 10) + (256 << 10)  # what the gateway holds: its limit and at most one read more


def test_a_percent_encoded_tenant_or_endpoint_name_routes_as_its_decoded_self():
    async def scenario(port, gateway, replica):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /e/%%74/%%65/p HTTP/1.1\r\nHost: g\r\n%s\r\n" % AUTH)
        status, _, body = await read_answer(reader)
        writer.close()
        return status, json.loads(body)["target"]

    assert run_apart(with_echo(scenario)) == (200, "/p")


def test_a_connection_that_sends_no_whole_request_is_closed_after_the_idle_time():
    """Idle kept-alive connections, and a client that sends a request a byte at a time, are let go; a
    request being answered, however long, is not cut by it."""

    async def handler(request, reply):
        await asyncio.sleep(0.5)  # longer than the idle time: answering is not idling
        reply.send(200, [], b"late")

    async def scenario():
        server = await serve(handler, "127.0.0.1", 0, idle_s=0.3)
        port = server.sockets[0].getsockname()[1]
        try:
            silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
            slow_reader, slow = await asyncio.open_connection("127.0.0.1", port)
            slow.write(b"GET / HT")  # and never the rest
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: g\r\n\r\n")
            answered = await read_answer(reader)
            started = asyncio.get_running_loop().time()
            closed = await asyncio.wait_for(reader.read(), 2) == b""  # kept alive, then idle: closed
            idle_for = asyncio.get_running_loop().time() - started
            silent_closed = await asyncio.wait_for(silent_reader.read(), 2) == b""
            slow_closed = await asyncio.wait_for(slow_reader.read(), 2) == b""
            for w in (silent, slow, writer):
                w.close()
            return answered[0], answered[2], closed, round(idle_for, 1), silent_closed, slow_closed
        finally:
            server.close()

    status, body, closed, idle_for, silent_closed, slow_closed = run_apart(scenario())
    assert (status, body, closed, silent_closed, slow_closed) == (200, b"late", True, True, True)
    assert 0.2 <= idle_for <= 1.0


def test_a_handler_that_answers_nothing_is_500_in_the_error_shape():
    async def handler(request, reply):
        return None  # forgot to answer

    assert run_apart(served_once(handler)) == (500, "server_error", True)
