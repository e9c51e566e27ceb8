"""The gateway's HTTP/1.1 client to replicas: kept-alive connections and one write per request.

aiohttp's ``ClientSession`` cost the gateway ~150 µs of CPU a request (a request
and a response object, timers, cookie handling, a chunked re-encoding of every
answer), and asyncio's stream reader most of the rest; this client writes the
request in one piece on a pooled connection, an asyncio protocol, and reads the
answer with httptools' parser (C) as it arrives. What it speaks is what a
replica answers: a status line, headers, and a body framed by
``Content-Length``, by ``Transfer-Encoding: chunked`` (token streaming), or
by the connection's close.

    pool = UpstreamPool()
    async with pool.exchange(host, port, b"POST /predict HTTP/1.1\\r\\n...") as answer:
        answer.status, answer.headers          # read before the block is entered
        async for chunk in answer.body(): ...  # the body, as it arrives

``UpstreamFailed`` means the replica sent not one byte of an answer (refused,
reset, or closed before the status line): the only failure the gateway may
retry on another replica. A failure after that is ``UpstreamBroken``.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httptools

CONNECT_TIMEOUT_S = 2.0
IDLE_KEPT = 512  # idle connections kept per replica; more are closed when they come back
HEAD_LIMIT = 64 << 10  # the status line and headers
WHOLE_MAX = 1 << 20  # an answer of a known length up to this is handed over once it is all in (Answer.whole)
HELD_MAX = 256 << 10  # a streamed answer's bytes held for a slow client; the replica is not read beyond that
NO_BODY_STATUSES = frozenset({204, 304})


class UpstreamFailed(Exception):
    """The replica answered nothing: the request may be retried on another replica."""


class UpstreamBroken(Exception):
    """The replica's answer broke off, or was not HTTP: too late to retry."""


class Answer:
    """The replica's status and headers, and its body as an async iterator of chunks."""

    __slots__ = ("connection", "status", "headers", "framing", "length", "complete", "keep_alive", "failure",
                 "held", "held_bytes", "waiter")  # fmt: skip

    def __init__(self, connection: Connection, status: int, headers: list[tuple[bytes, bytes]], framing: str,
                 length: int, keep_alive: bool):  # fmt: skip
        self.connection = connection
        self.status = status
        self.headers = headers
        self.framing = framing  # "length", "chunked", "close" or "none"
        self.length = length  # the Content-Length when framing is "length"
        self.complete = framing == "none"  # the whole body was read: the connection may carry another request
        self.keep_alive = keep_alive and framing != "close"
        self.failure: UpstreamBroken | None = None
        self.held: deque[bytes] = deque()  # body bytes read and not yet taken
        self.held_bytes = 0
        self.waiter: asyncio.Future | None = None

    @property
    def whole(self) -> bool:
        """Handed over with its body all in (no body, or a known length up to ``WHOLE_MAX``): ``read`` it and
        send it in one write. Else the body streams (``body``)."""
        return self.framing == "none" or (self.framing == "length" and self.length <= WHOLE_MAX)

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            if self.failure is not None:
                raise self.failure
            await self._wait()
        body = b"".join(self.held)
        self.held.clear()
        return body

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            while self.held:
                chunk = self.held.popleft()
                self.held_bytes -= len(chunk)
                self.connection.taken(self.held_bytes)
                yield chunk
            if self.complete:
                return
            if self.failure is not None:
                raise self.failure
            await self._wait()

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One kept-alive connection to a replica: one request at a time, its answer parsed as it arrives."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future | None = None  # the answer awaited (resolved once its head is in)
        self.answer: Answer | None = None
        self.head_only = False  # a HEAD request: its answer has no body, whatever its length says
        self.lost = False
        self.paused = False
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._interim = False

    def usable(self) -> bool:
        return not self.lost and self.head is None and self.answer is None and not self.transport.is_closing()

    def send(self, request: bytes, head_only: bool) -> asyncio.Future:
        """Write ``request``; the future resolves to the answer once its head is in."""
        self.head = asyncio.get_running_loop().create_future()
        self.head_only = head_only
        self.transport.write(request)
        return self.head

    def done(self) -> None:
        """The answer was taken whole: the connection may carry the next request."""
        self.answer = None

    def close(self) -> None:
        self.transport.close()

    # --- transport events -----------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("the replica switched protocols, which the gateway does not proxy"))
            self.transport.close()
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback raised
            self._fail(cause if isinstance(cause, UpstreamBroken) else UpstreamBroken(f"not an HTTP/1 answer: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.lost = True
        answer = self.answer
        if self.head is not None and not self.head.done():
            if answer is None:
                self.head.set_exception(UpstreamFailed(f"the replica closed the connection before answering: {exc!r}"))
            else:  # the head was in, the body cut short
                self.head.set_exception(UpstreamBroken(f"the answer broke off: {exc!r}"))
        if answer is not None and not answer.complete and answer.failure is None:
            if answer.framing == "close":
                answer.complete = True  # a body framed by the connection's close ends here
            else:
                answer.failure = UpstreamBroken(f"the answer broke off: {exc!r}")
            answer._wake()

    def taken(self, held_bytes: int) -> None:
        """The gateway took body bytes: read the replica again once few are held."""
        if self.paused and held_bytes < HELD_MAX // 2:
            self.paused = False
            self.transport.resume_reading()

    def _fail(self, failure: UpstreamBroken) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(failure)
        elif self.answer is not None and self.answer.failure is None:
            self.answer.failure = failure
            self.answer._wake()

    # --- parser callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.head is None:
            raise UpstreamBroken("the replica sent an answer nobody asked for")
        self._headers = []
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > HEAD_LIMIT:
            raise UpstreamBroken("the answer's headers are over 64 KiB")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200 and status != 101:
            self._interim = True  # 1xx (100 Continue, 103 Early Hints): the answer follows
            return
        framing, length = "close", 0
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"transfer-encoding" and b"chunked" in value.lower():
                framing = "chunked"
            elif lowered == b"content-length" and framing != "chunked":
                if not value.strip().isdigit():
                    raise UpstreamBroken(f"the answer's Content-Length is not a number: {value[:40]!r}")
                framing, length = "length", int(value)
        keep_alive = self.parser.should_keep_alive()
        if self.head_only or status in NO_BODY_STATUSES or (framing == "length" and length == 0):
            framing = "none"
            keep_alive = keep_alive and not self.head_only  # the parser still waits for a HEAD answer's body
        self.answer = Answer(self, status, self._headers, framing, length, keep_alive)
        if not self.answer.whole or framing == "none":
            self._resolve()  # else handed over once its body is in: one wake-up of the gateway, not two

    def _resolve(self) -> None:
        head, self.head = self.head, None
        head.set_result(self.answer)

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        answer.held.append(body)
        answer.held_bytes += len(body)
        if answer.held_bytes > HELD_MAX and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        answer._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self.answer is not None:
            self.answer.complete = True
            if self.head is not None:
                self._resolve()
            self.answer._wake()


class UpstreamPool:
    def __init__(self):
        self.idle: dict[tuple[str, int], list[Connection]] = {}
        self.busy: set[Connection] = set()  # carrying a request now
        self.closed = False

    async def _connect(self, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(Connection, host.strip("[]"), port), CONNECT_TIMEOUT_S
            )  # an IPv6 address comes as it is written in a URL, in brackets
        except (OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"could not connect to {host}:{port}: {exc!r}") from exc
        return connection

    def _take(self, key: tuple[str, int]) -> Connection | None:
        idle = self.idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.close()
        return None

    def _give_back(self, key: tuple[str, int], connection: Connection) -> None:
        connection.done()
        idle = self.idle.setdefault(key, [])
        if self.closed or len(idle) >= IDLE_KEPT or not connection.usable():
            connection.close()
        else:
            idle.append(connection)

    @asynccontextmanager
    async def exchange(self, host: str, port: int, request: bytes) -> AsyncIterator[Answer]:
        """Send ``request`` (a whole HTTP/1.1 request) and yield the answer once its head is in.

        A kept-alive connection the replica closed while idle is the one race of connection reuse:
        nothing was answered on it, so the request goes once more on a new connection."""
        key = (host, port)
        head_only = request.startswith(b"HEAD ")
        connection = self._take(key)
        answer = None
        if connection is not None:
            try:
                answer = await connection.send(request, head_only)
            except UpstreamFailed:
                connection.close()
            except BaseException:
                connection.close()
                raise
        if answer is None:
            connection = await self._connect(host, port)
            try:
                answer = await connection.send(request, head_only)
            except BaseException:
                connection.close()
                raise
        self.busy.add(connection)
        try:
            yield answer
        finally:
            self.busy.discard(connection)
            if answer.complete and answer.keep_alive and not answer.held:
                self._give_back(key, connection)
            else:
                connection.close()  # an answer not read to its end: the connection is out of step

    def keep_only(self, replicas: set[tuple[str, int]]) -> None:
        """Close the idle connections to replicas no longer in the routing table."""
        for key in [key for key in self.idle if key not in replicas]:
            for connection in self.idle.pop(key):
                connection.close()

    async def close(self) -> None:
        self.closed = True
        for connection in [*self.busy, *(c for idle in self.idle.values() for c in idle)]:
            connection.close()
        self.idle.clear()
