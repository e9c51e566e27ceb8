"""The SDK's direct HTTP: kept-alive ``http.client`` connections, retried by urllib3's ``Retry`` policy.

urllib3's pool manager cost a call ~150-200 µs of the client's CPU on top of
``http.client``'s own (a pool key per request, header dictionaries, a response
wrapper, the headers and the body of a POST in two writes): half of what the
SDK spent on a submit, and a CI runner's loop submitting a sweep waits for it.
A call through a proxy (``HTTPS_PROXY`` / ``HTTP_PROXY``) still goes through
urllib3's ``ProxyManager`` (``client.pool_manager``); a direct one goes here.

What is kept of urllib3 is its retry policy, whole: the same ``Retry`` object
decides what is retried (connection failures, answers lost on the way back,
the statuses of ``status_forcelist``), how many times, and how long to wait
(``Retry-After`` honoured, else exponential backoff), and raises the same
``MaxRetryError`` once it is spent. A connection the server closed while it sat
idle is replaced before it is used, as urllib3 does.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
from collections.abc import Mapping
from urllib.parse import urlsplit

from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError, ReadTimeoutError
from urllib3.util.retry import Retry

Origin = tuple[str, str, int]  # scheme, host, port


class Answer:
    """A whole answer: what ``Client.request`` and urllib3's ``Retry`` read of one."""

    __slots__ = ("status", "headers", "data")

    def __init__(self, status: int, headers, data: bytes):
        self.status = status
        self.headers = headers  # http.client's message: ``get`` ignores the name's case
        self.data = data

    def get_redirect_location(self) -> bool:
        return False  # redirects are not followed (the API answers none)


class _OneWrite:
    """``http.client`` sends a request's head and its body in two writes: two segments, and two wake-ups of
    the server for one request. A body in bytes goes with the head here, in one."""

    _buffer: list[bytes]

    def _send_output(self, message_body=None, encode_chunked=False):
        if not isinstance(message_body, bytes):
            return super()._send_output(message_body, encode_chunked)
        self._buffer.extend((b"", b""))
        request = b"\r\n".join(self._buffer) + message_body
        del self._buffer[:]
        self.send(request)
        return None


class _HTTP(_OneWrite, http.client.HTTPConnection):
    pass


class _HTTPS(_OneWrite, http.client.HTTPSConnection):
    pass


class Direct:
    """Kept-alive connections per origin, safe to share between threads."""

    def __init__(self, *, retries: Retry, timeout: tuple[float, float]):
        self.retries = retries
        self.connect_timeout, self.read_timeout = timeout
        self.idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def request(self, method: str, url: str, *, body: bytes | None, headers: Mapping[str, str]) -> Answer:
        """The answer to ``method`` ``url``, retried as ``retries`` says; raises urllib3's ``MaxRetryError``
        (or the failure itself, where the policy says not to retry it) when it cannot be had."""
        parts = urlsplit(url)
        origin = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        retry = self.retries
        while True:
            try:
                answer = self._once(origin, method, target, body, headers)
            except _Failed as failed:
                retry = retry.increment(method, url, error=failed.error)  # raises once the policy is spent
                retry.sleep()
                continue
            if not retry.is_retry(method, answer.status, "Retry-After" in answer.headers):
                return answer
            try:
                retry = retry.increment(method, url, response=answer)
            except MaxRetryError:  # spent on statuses: the last answer is the caller's (raise_on_status=False)
                return answer
            retry.sleep(answer)

    def _once(self, origin: Origin, method: str, target: str, body: bytes | None, headers) -> Answer:
        connection = self._take(origin)
        connected = connection.sock is not None
        try:
            if not connected:
                connection.connect()
                connection.sock.settimeout(self.read_timeout)
                connected = True
            connection.request(method, target, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            if not connected:  # refused, unreachable, timed out, TLS refused: nothing was sent
                raise _Failed(NewConnectionError(None, f"cannot connect to {origin[1]}:{origin[2]}: {exc}")) from exc
            if isinstance(exc, TimeoutError):
                raise _Failed(ReadTimeoutError(None, target, f"no answer within {self.read_timeout} s")) from exc
            raise _Failed(ProtocolError(f"the connection broke: {exc!r}", exc)) from exc
        if response.will_close:
            connection.close()
        else:
            self._give_back(origin, connection)
        return Answer(response.status, response.headers, data)

    def _take(self, origin: Origin) -> http.client.HTTPConnection:
        with self.lock:
            idle = self.idle.get(origin)
            while idle:
                connection = idle.pop()
                if not _dropped(connection):
                    return connection
                connection.close()
        scheme, host, port = origin
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            return _HTTPS(host, port, timeout=self.connect_timeout, context=self._tls)
        return _HTTP(host, port, timeout=self.connect_timeout)

    def _give_back(self, origin: Origin, connection: http.client.HTTPConnection) -> None:
        with self.lock:
            self.idle.setdefault(origin, []).append(connection)

    def clear(self) -> None:
        with self.lock:
            for idle in self.idle.values():
                for connection in idle:
                    connection.close()
            self.idle.clear()


class _Failed(Exception):
    """A call that got no answer; ``error`` is the urllib3 error ``Retry`` judges it by."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _dropped(connection: http.client.HTTPConnection) -> bool:
    """Whether a kept-alive connection was closed by the server while idle (readable means EOF or junk)."""
    sock = connection.sock
    if sock is None:
        return False  # not connected yet: it will connect
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
