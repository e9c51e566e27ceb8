"""The gateway's HTTP/1.1 client to replicas: kept-alive connections and one write per request.

aiohttp's ``ClientSession`` cost the gateway ~150 µs of CPU a request (a request
and a response object, timers, cookie handling, a chunked re-encoding of every
answer); this client writes the request in one piece on a pooled connection
and reads the answer with asyncio's stream reader. What it speaks is what a
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

CONNECT_TIMEOUT_S = 2.0
IDLE_KEPT = 512  # idle connections kept per replica; more are closed when they come back
HEAD_LIMIT = 64 << 10  # the status line and headers
READ_SIZE = 64 << 10
NO_BODY_STATUSES = frozenset({204, 304})


class UpstreamFailed(Exception):
    """The replica answered nothing: the request may be retried on another replica."""


class UpstreamBroken(Exception):
    """The replica's answer broke off, or was not HTTP: too late to retry."""


@dataclass
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing() and self.reader.exception() is None


class Answer:
    """The replica's status and headers, and its body as an async iterator of chunks."""

    def __init__(self, connection: Connection, status: int, headers: list[tuple[str, str]], framing, length: int):
        self.connection = connection
        self.status = status
        self.headers = headers
        self.framing = framing  # "length", "chunked", "close" or "none"
        self.length = length  # the Content-Length when framing is "length"
        self.complete = framing == "none"  # the whole body was read: the connection may carry another request
        self.keep_alive = True

    async def read(self) -> bytes:
        if self.framing == "length":  # the common answer: one read, no generator
            try:
                data = await self.connection.reader.readexactly(self.length)
            except (asyncio.IncompleteReadError, OSError) as exc:
                raise UpstreamBroken(f"the answer ended short of its Content-Length: {exc!r}") from exc
            self.complete = True
            return data
        return b"".join([chunk async for chunk in self.body()])

    async def body(self) -> AsyncIterator[bytes]:
        reader = self.connection.reader
        try:
            if self.framing == "length":
                left = self.length
                while left:
                    chunk = await reader.read(min(left, READ_SIZE))
                    if not chunk:
                        raise UpstreamBroken(f"the answer ended {left} bytes short of its Content-Length")
                    left -= len(chunk)
                    yield chunk
            elif self.framing == "chunked":
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers: dropped (hop-by-hop)
                        break
                    chunk = await reader.readexactly(size + 2)
                    yield chunk[:-2]
            elif self.framing == "close":
                while chunk := await reader.read(READ_SIZE):
                    yield chunk
                self.keep_alive = False
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as exc:
            raise UpstreamBroken(f"the answer broke off: {exc!r}") from exc
        self.complete = True


def _head(raw: bytes) -> tuple[int, list[tuple[str, str]], bool]:
    """(status, headers, HTTP/1.1 keep-alive) from a response head; ValueError when it is not HTTP."""
    status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
    version, status, *_ = status_line.split(" ", 2)
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1 answer: {status_line[:80]!r}")
    headers = []
    for line in lines:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return int(status), headers, version == "HTTP/1.1"


class UpstreamPool:
    def __init__(self):
        self.idle: dict[tuple[str, int], list[Connection]] = {}
        self.closed = False

    async def _connect(self, host: str, port: int) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=HEAD_LIMIT), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"could not connect to {host}:{port}: {exc!r}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(reader, writer)

    def _take(self, key: tuple[str, int]) -> Connection | None:
        idle = self.idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.writer.close()
        return None

    def _give_back(self, key: tuple[str, int], connection: Connection) -> None:
        idle = self.idle.setdefault(key, [])
        if self.closed or len(idle) >= IDLE_KEPT or not connection.usable():
            connection.writer.close()
        else:
            idle.append(connection)

    async def _send(self, connection: Connection, request: bytes, method: bytes) -> Answer:
        connection.writer.write(request)
        reader = connection.reader
        while True:
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, OSError) as exc:
                raise UpstreamFailed(f"the replica closed the connection before answering: {exc!r}") from exc
            except asyncio.LimitOverrunError as exc:
                raise UpstreamBroken("the answer's headers are over 64 KiB") from exc
            try:
                status, headers, keep_alive = _head(raw)
            except ValueError as exc:
                raise UpstreamBroken(str(exc)) from exc
            if status >= 200 or status == 101:
                break  # 1xx (100 Continue, 103 Early Hints): the answer follows
        framing, length = "close", 0
        for name, value in headers:
            lowered = name.lower()
            if lowered == "transfer-encoding" and "chunked" in value.lower():
                framing = "chunked"
            elif lowered == "content-length" and framing != "chunked":
                framing, length = "length", int(value)
            elif lowered == "connection" and "close" in value.lower():
                keep_alive = False
        if method == b"HEAD" or status in NO_BODY_STATUSES or (framing == "length" and length == 0):
            framing = "none"
        answer = Answer(connection, status, headers, framing, length)
        answer.keep_alive = keep_alive and framing != "close"
        return answer

    @asynccontextmanager
    async def exchange(self, host: str, port: int, request: bytes) -> AsyncIterator[Answer]:
        """Send ``request`` (a whole HTTP/1.1 request) and yield the answer once its head is in.

        A kept-alive connection the replica closed while idle is the one race of connection reuse:
        nothing was answered on it, so the request goes once more on a new connection."""
        key = (host, port)
        method = request[: request.index(b" ")]
        connection = self._take(key)
        if connection is not None:
            try:
                answer = await self._send(connection, request, method)
            except UpstreamFailed:
                connection.writer.close()
                connection = None
            except BaseException:
                connection.writer.close()
                raise
        if connection is None:
            connection = await self._connect(host, port)
            try:
                answer = await self._send(connection, request, method)
            except BaseException:
                connection.writer.close()
                raise
        try:
            yield answer
        finally:
            if answer.complete and answer.keep_alive:
                self._give_back(key, connection)
            else:
                connection.writer.close()  # an answer not read to its end: the connection is out of step

    def keep_only(self, replicas: set[tuple[str, int]]) -> None:
        """Close the idle connections to replicas no longer in the routing table."""
        for key in [key for key in self.idle if key not in replicas]:
            for connection in self.idle.pop(key):
                connection.writer.close()

    async def close(self) -> None:
        self.closed = True
        for idle in self.idle.values():
            for connection in idle:
                connection.writer.close()
        self.idle.clear()
