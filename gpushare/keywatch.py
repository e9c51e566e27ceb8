"""Redis telling this process, on a connection of its own, that a key under a prefix changed.

Redis's server-assisted client-side caching in broadcasting mode (``CLIENT TRACKING ON BCAST PREFIX p``,
RESP3): whenever any client writes, deletes, expires or evicts a key starting with ``p``, Redis pushes
``invalidate [key]`` to every connection tracking that prefix (``invalidate nil`` after a FLUSHDB or
FLUSHALL). ``accounts.principal_cache`` uses it to trust a cached token check without asking Redis on
every request.

A watch never blocks a request. :meth:`KeyWatch.poll` reads, without waiting, whatever the socket holds
and hands each notice to ``on_change`` before it answers. So a notice that reached this host before a
request starts is applied before that request looks at the cache.

**What "live" means.** Redis answers on a connection in order, so a PONG proves that every notice Redis
queued before it read the PING has arrived. The watch sends a PING at most every ``PING_EVERY_S``, from
a poll, one at a time. :meth:`poll` answers True only while the last PING answered was sent less than
``LIVE_FOR_S`` ago. So a link that went silent (a partition, a paused server) stops being live within
``LIVE_FOR_S``, and so does one that was idle for longer: the first request after a quiet spell sends
the PING and is not trusted. A PING unanswered for ``LIVE_FOR_S``, a closed or a broken link: the watch
calls ``on_change(None)`` (forget everything), bumps :attr:`KeyWatch.epoch`, and dials again at most
every ``RETRY_S``.

**Kept live while the process is quiet** (:meth:`KeyWatch.keep`). Polled by requests alone, a watch was
live only for a process answering a request at least every second or so: a CI pipeline polling every few
seconds found it stale at every call, and each call asked Redis instead (0.25-0.4 ms after an idle second
on the bench machine, docs/benchmarks.md, session 29). A kept watch is also polled every ``KEEP_EVERY_S``
by one daemon thread per process (started again in a forked child at its first poll), which applies the
notices, sends the PINGs and dials a lost link again, off any request. What "live" proves is unchanged:
the thread only does what a request's poll would have done.

TLS (``rediss://``) goes through redis-py's own TLS set-up for the URL. **Not covered:** Unix-socket
URLs: :func:`watch_for` answers None and the caller keeps checking Redis on every request. No Django
here.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable

import hiredis

log = logging.getLogger(__name__)

PING_EVERY_S = 1.0
LIVE_FOR_S = 3.0  # a PONG older than this: the watch is not live
RETRY_S = 2.0  # between dials after the link failed
KEEP_EVERY_S = 0.5  # a kept watch's poll from the keeper thread: its last answered PING is never older than ~1.5 s
CONNECT_TIMEOUT_S = 1.0
READ_SIZE = 1 << 16

_watches: weakref.WeakSet = weakref.WeakSet()


def command(*args) -> bytes:
    """One command in RESP."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class LinkLost(Exception):
    pass


class KeyWatch:
    """Notices of changed keys under ``prefix``, for one process (see the module's docstring)."""

    def __init__(
        self, *, host: str, port: int, prefix: str, on_change: Callable, username: str | None = None,
        password: str | None = None, wrap: Callable[[socket.socket], socket.socket] | None = None,
    ):  # fmt: skip
        self.address = (host, port)
        self.wrap = wrap  # TLS: the connected socket in, the wrapped one out
        self.username, self.password = username, password
        self.prefix = prefix
        self.on_change = on_change  # called with a list of keys (bytes), or None: forget every key
        self.epoch = 0  # bumped when the link is made or lost: what was learnt under another one is not trusted
        self.seen = 0  # notices applied so far (and links made): a caller compares it across its own reads
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader: hiredis.Reader | None = None
        self._buffer = bytearray(READ_SIZE)
        self._ping_sent = 0.0
        self._pong_at = float("-inf")  # when the PING last answered was sent
        self._pings_unanswered = 0
        self._dial_at = 0.0
        self._failures = 0
        self.kept = False
        _watches.add(self)

    def keep(self) -> None:
        """Keep this watch live while the process serves nothing: polled by the keeper thread every
        ``KEEP_EVERY_S`` as well as by requests (see the module's docstring)."""
        self.kept = True
        _keeper_ensure()

    def poll(self) -> bool:
        """Apply every notice that has arrived; True while the watch is live (a PONG within LIVE_FOR_S)."""
        if self.kept and _keeper is None:  # a forked child: its parent's keeper thread is not here
            _keeper_ensure()
        with self._lock:
            now = time.monotonic()
            if self._sock is None:
                if now < self._dial_at:
                    return False
                self._dial(now)
                return False  # live once its first PONG is read
            try:
                self._drain()
                if now - self._ping_sent >= PING_EVERY_S:
                    if self._pings_unanswered and now - self._ping_sent >= LIVE_FOR_S:
                        raise LinkLost(f"no PONG within {LIVE_FOR_S:g} s")
                    if not self._pings_unanswered:
                        self._sock.send(command("PING"))
                        self._ping_sent = now
                        self._pings_unanswered = 1
            except (OSError, LinkLost, hiredis.ProtocolError) as exc:
                self._lost(exc, now)
                return False
            return now - self._pong_at < LIVE_FOR_S

    def close(self) -> None:
        self.kept = False  # the keeper would dial it again
        with self._lock:
            if self._sock is not None:
                self._lost(None, time.monotonic())

    # --- the link -------------------------------------------------------------------

    def _dial(self, now: float) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self._failed(exc, now)
            return
        reader = hiredis.Reader()
        hello = ["HELLO", 3]
        if self.wrap is not None:
            try:
                sock = self.wrap(sock)
            except OSError as exc:
                sock.close()
                self._failed(exc, now)
                return
        if self.password is not None:
            hello += ["AUTH", self.username or "default", self.password]
        try:
            sock.sendall(command(*hello) + command("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", self.prefix))
            answers = []
            while len(answers) < 2:
                data = sock.recv(READ_SIZE)
                if not data:
                    raise LinkLost("Redis closed the connection")
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    if isinstance(reply, hiredis.ReplyError):
                        raise LinkLost(f"Redis refused: {reply}")
                    if not isinstance(reply, hiredis.PushNotification):
                        answers.append(reply)
            sock.setblocking(False)
        except (OSError, LinkLost, hiredis.ProtocolError) as exc:
            sock.close()
            self._failed(exc, now)
            return
        self._sock, self._reader = sock, reader
        self.epoch += 1
        self.seen += 1
        self._sock.send(command("PING"))
        self._ping_sent, self._pings_unanswered = now, 1
        if self._failures:
            log.warning("key watch on %s:%s is back after %d failed attempt(s)", *self.address, self._failures)
        self._failures = 0

    def _drain(self) -> None:
        while True:
            try:
                n = self._sock.recv_into(self._buffer)
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            if n == 0:
                raise LinkLost("Redis closed the connection")
            self._reader.feed(self._buffer, 0, n)
            while (reply := self._reader.gets()) is not False:
                if isinstance(reply, hiredis.PushNotification):
                    if len(reply) >= 2 and reply[0] == b"invalidate":
                        self.seen += 1
                        self.on_change(reply[1])
                elif reply == b"PONG":  # the answer to the one PING in flight: all sent before it is here
                    self._pong_at = self._ping_sent
                    self._pings_unanswered = 0
                elif isinstance(reply, hiredis.ReplyError):
                    raise LinkLost(f"Redis refused: {reply}")

    def _lost(self, exc: BaseException | None, now: float) -> None:
        if exc is not None:
            log.warning("key watch on %s:%s lost (%s); cached checks are asked of Redis again", *self.address, exc)
        self._unlink()
        self._dial_at = now + RETRY_S
        self.on_change(None)

    def _failed(self, exc: BaseException, now: float) -> None:
        if not self._failures:
            log.warning("key watch on %s:%s could not connect (%s); retrying every %g s", *self.address, exc, RETRY_S)
        self._failures += 1
        self._dial_at = now + RETRY_S

    def _forked(self) -> None:
        """In a forked child: the parent's socket is not this process's link."""
        self._lock = threading.Lock()
        self._unlink()
        self._dial_at = 0.0

    def _unlink(self) -> None:
        """Close the link (if any); nothing learnt on it is trusted any more."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = self._reader = None
        self._pong_at = float("-inf")
        self._pings_unanswered = 0
        self.epoch += 1
        self.seen += 1


_keeper: threading.Thread | None = None  # this process's keeper thread, once a watch is kept
_keeper_lock = threading.Lock()


def _keeper_ensure() -> None:
    global _keeper
    with _keeper_lock:
        if _keeper is None:
            _keeper = threading.Thread(target=_keep, name="gpushare-keywatch", daemon=True)
            _keeper.start()


def _keep() -> None:
    """The keeper thread: every ``KEEP_EVERY_S``, poll each kept watch of this process."""
    while True:
        time.sleep(KEEP_EVERY_S)
        for watch in list(_watches):
            if watch.kept:
                try:
                    watch.poll()
                except Exception:  # a failing on_change must not end the thread; requests poll regardless
                    log.exception("key watch on %s:%s: the keeper's poll failed", *watch.address)


def _after_fork() -> None:
    global _keeper, _keeper_lock
    _keeper, _keeper_lock = None, threading.Lock()  # threads do not survive a fork: the next poll starts one
    for watch in list(_watches):
        watch._forked()


os.register_at_fork(after_in_child=_after_fork)


def watch_for(client, *, prefix: str, on_change: Callable) -> KeyWatch | None:
    """A watch on the server ``client`` (a ``redis.Redis``) talks to, over TLS when it uses TLS (with
    its certificates and checks), or None where it cannot be made (a Unix socket)."""
    from redis.connection import Connection, SSLConnection

    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    wrap = None
    if pool.connection_class is SSLConnection:
        # redis-py's own TLS set-up for this URL (CA, client certificate, hostname check, versions).
        wrap = SSLConnection(**kwargs)._wrap_socket_with_ssl
    elif pool.connection_class is not Connection:
        return None
    return KeyWatch(
        wrap=wrap,
        host=kwargs.get("host", "localhost"),
        port=int(kwargs.get("port", 6379)),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        prefix=prefix,
        on_change=on_change,
    )
