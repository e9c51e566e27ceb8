"""The gateway's HTTP/1.1 server: asyncio protocols over httptools' parser (llhttp, as in Node and uvicorn).

aiohttp's server cost the gateway ~160-220 µs of CPU a request, as much as the
replica behind it; on a machine whose cores the load also runs on, that capped
the proxied throughput near two thirds of the direct one. Here a request is
parsed in C, handed to the handler as bytes (nothing decoded that the proxy
only passes on), and answered in one ``write``.

    async def handler(request: Request, reply: Reply) -> None:
        reply.send(200, [(b"Content-Type", b"text/plain")], b"hi")

    server = await serve(handler, "127.0.0.1", 8001)

One task runs per request. Requests a client sends ahead (pipelining) wait their
turn, in order. A client that goes away (or closes its sending side: HTTP/1.1
clients do not half-close) cancels its request's task, so a held or forwarded
request does not outlive it. A request over ``max_body`` is answered
413, bad HTTP 400, and a handler that fails or answers nothing 500; each closes
the connection. A connection that has not sent a whole request for ``IDLE_S``
(75 s, as nginx and aiohttp keep an idle one) is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools

log = logging.getLogger("gpushare.gateway")

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
REFUSED_CODES = {413: "too_large", 500: "server_error", 501: "not_implemented"}
PIPELINED_MAX = 16  # requests read ahead of the one being answered; reading pauses beyond that
IDLE_S = 75.0  # a connection with no request in progress is closed once it has not sent a whole one for this
Header = tuple[bytes, bytes]


class Request:
    """One request as the client sent it: method, target (path and query, not decoded), headers, body."""

    __slots__ = ("method", "target", "headers", "body", "version", "keep_alive", "peer")

    def __init__(self, method: bytes, target: bytes, headers: list[Header], body: bytes, version: str,
                 keep_alive: bool, peer):  # fmt: skip
        self.method = method
        self.target = target
        self.headers = headers  # as sent: names keep their case, repeats stay
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self.peer = peer  # (address, port) of the client

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header; ``name`` in lower case."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]


class Reply:
    """How a handler answers: ``send`` a whole answer, or ``start``, ``write`` and ``finish`` a streamed one.

    ``status`` is what was sent (0 before). Writing to a client that went away raises ConnectionResetError."""

    __slots__ = ("connection", "head_only", "keep_alive", "status", "chunked", "ended")

    def __init__(self, connection: Connection, request: Request):
        self.connection = connection
        self.head_only = request.method == b"HEAD"
        self.keep_alive = request.keep_alive
        self.status = 0
        self.chunked = False
        self.ended = False  # the whole answer was written: the connection may carry the next request

    def _head(self, status: int, headers: list[Header], framing: bytes) -> bytearray:
        if self.status:
            raise RuntimeError("this request was answered already")
        self.status = status
        head = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Unknown")))
        for name, value in headers:
            head += name + b": " + value + b"\r\n"
        head += framing
        if not self.keep_alive:
            head += b"Connection: close\r\n"
        head += b"\r\n"
        return head

    def send(self, status: int, headers: list[Header], body: bytes = b"") -> None:
        """The whole answer in one write, framed by its length."""
        head = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        if not self.head_only:
            head += body
        self.ended = True
        self.connection.write(head)

    def start(self, status: int, headers: list[Header], length: int | None = None) -> None:
        """The head of a streamed answer: framed by ``length`` when known, else chunked (HTTP/1.1) or by
        closing the connection (an HTTP/1.0 client)."""
        if length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif self.connection.version_11:
            framing, self.chunked = b"Transfer-Encoding: chunked\r\n", True
        else:
            framing, self.keep_alive = b"", False
        self.connection.write(self._head(status, headers, framing))

    async def write(self, chunk: bytes) -> None:
        if not chunk or self.head_only:
            return
        self.connection.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        await self.connection.drained()

    def finish(self) -> None:
        if self.chunked and not self.head_only:
            self.connection.write(b"0\r\n\r\n")
        self.ended = True

    def abort(self) -> None:
        """Close the client's connection: an answer that broke off must not pass for a whole one."""
        self.keep_alive = False
        self.connection.close()


Handler = Callable[[Request, Reply], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection: parses requests and runs the handler on each, one at a time, in order."""

    def __init__(self, handler: Handler, max_body: int, idle_s: float = IDLE_S):
        self.handler = handler
        self.max_body = max_body
        self.idle_s = idle_s
        self.idle_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = None
        self.waiting: deque[Request] = deque()
        self.task: asyncio.Task | None = None
        self.lost = False
        self.paused_reading = False
        self.drain_waiter: asyncio.Future | None = None
        self.version_11 = True
        self._url = b""
        self._headers: list[Header] = []
        self._body: list[bytes] = []
        self._size = 0

    # --- transport events -----------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        self.idle_from_now()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(501, "protocol upgrades are not supported by the gateway")
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback raised
            if isinstance(cause, TooLarge):
                self.refuse(413, f"the request body is over {self.max_body} bytes")
            elif cause is not None:
                log.error("the gateway failed reading a request", exc_info=cause)
                self.refuse(500, "the gateway failed reading the request")
            else:
                self.refuse(400, f"bad HTTP request: {exc}"[:200])

    def eof_received(self) -> bool:
        return False  # the client closed its side: gone, as nginx and aiohttp take it (connection_lost follows)

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.waiting.clear()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.task is not None:
            self.task.cancel()  # the client went away: nobody waits for this answer
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self.drain_waiter = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)
        self.drain_waiter = None

    # --- parser callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"content-length" and value.isdigit() and int(value) > self.max_body:
                raise TooLarge()
            if lowered == b"expect" and value.lower() == b"100-continue" and self.task is None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            raise TooLarge()
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        request = Request(parser.get_method(), self._url, self._headers, b"".join(self._body), version,
                          parser.should_keep_alive(), self.peer)  # fmt: skip
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.task is None:
            self.run(request)
        else:
            self.waiting.append(request)
            if len(self.waiting) >= PIPELINED_MAX and not self.paused_reading:
                self.paused_reading = True
                self.transport.pause_reading()

    # --- answering ------------------------------------------------------------------

    def run(self, request: Request) -> None:
        self.version_11 = request.version == "1.1"
        self.task = asyncio.get_running_loop().create_task(self.answer(request))

    async def answer(self, request: Request) -> None:
        reply = Reply(self, request)
        try:
            await self.handler(request, reply)
        except asyncio.CancelledError:
            return  # the client went away (connection_lost)
        except ConnectionResetError:
            return
        except Exception:
            log.exception("the gateway failed answering %s %r", request.method.decode(), request.target[:200])
            if not reply.status:
                server_error(reply, "the gateway failed")
            self.close()
            return
        finally:
            self.task = None
        if not reply.status:
            log.error("the gateway answered nothing to %s %r", request.method.decode(), request.target[:200])
            server_error(reply, "the gateway answered nothing")
        if not reply.ended or not reply.keep_alive:
            self.close()
            return
        if self.waiting:
            self.run(self.waiting.popleft())
            if self.paused_reading and len(self.waiting) < PIPELINED_MAX // 2:
                self.paused_reading = False
                self.transport.resume_reading()
        else:
            self.idle_from_now()

    def idle_from_now(self) -> None:
        """Close the connection unless a whole request arrives within ``idle_s`` (kept-alive connections
        left open, and clients that send a request a byte at a time, do not hold the gateway's sockets)."""
        self.idle_timer = asyncio.get_running_loop().call_later(self.idle_s, self.close)

    def refuse(self, status: int, message: str) -> None:
        """A request that cannot be read: answered (unless one is being answered) and the connection closed."""
        if self.task is None and not self.lost:
            code = REFUSED_CODES.get(status, "bad_request")
            body = json.dumps({"error": {"code": code, "message": message, "fields": {}}}).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (status, REASONS[status], len(body), body))  # fmt: skip
        self.close()

    def write(self, data: bytes) -> None:
        if self.lost:
            raise ConnectionResetError("the client went away")
        self.transport.write(data)

    async def drained(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client went away")
        if self.drain_waiter is not None:
            await self.drain_waiter

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def server_error(reply: Reply, message: str) -> None:
    """A 500 in the API's error shape, and the connection closed after it."""
    reply.keep_alive = False
    body = {"error": {"code": "server_error", "message": message, "fields": {}}}
    reply.send(500, [(b"Content-Type", b"application/json; charset=utf-8")], json.dumps(body).encode())


class TooLarge(Exception):
    """A request body over the server's limit."""


async def serve(handler: Handler, host: str, port: int, *, max_body: int = 10 << 20, idle_s: float = IDLE_S,
                sock: socket.socket | None = None) -> asyncio.Server:  # fmt: skip
    """Listen on ``host``:``port`` (or on ``sock``) and answer each request with ``handler``."""
    loop = asyncio.get_running_loop()

    def protocol() -> Connection:
        return Connection(handler, max_body, idle_s)

    if sock is not None:
        return await loop.create_server(protocol, sock=sock, backlog=1024)
    return await loop.create_server(protocol, host, port, backlog=1024, reuse_address=True)
