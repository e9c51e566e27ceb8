"""Fresh shared reads: callers that ask for the same read at the same time share one run of it, and no caller
gets a result from a run that began before it asked.

A web process serves several requests at once (granian's threads). When pollers ask for the same thing (a
tenant's first page of jobs), each would send its own read, the same read, to the database. Here they take
turns as group commit does: the first caller runs the read (it **leads** a flight); callers that ask while
that flight is in the air wait for it to land, then one of them leads the next flight for all of them, and
they share its result.

Why a shared result is never older than what its caller could see on its own:

- Every call takes a number when it asks (``arrived``) and every flight one when it is created (``started``),
  from one counter; a flight is created before its read is sent.
- A caller takes a flight's result only when ``started > arrived``: the flight's read was sent after the
  caller asked, so its database snapshot includes every transaction committed before the caller asked
  (what a client wrote before it sent the request, say). A flight that was already in the air is waited
  out, never used.
- A flight whose read raised hands nothing on: its leader raises, and its waiters go round again (one of
  them leads the next flight).

So a caller waits at most for the flight in the air and the next one (unless a read fails), and a burst of
``n`` callers costs two reads instead of ``n``; a lone caller waits for nothing. What a read returns is
shared between callers: they must not change it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flight:
    __slots__ = ("started", "landed", "result", "failed", "waiters")

    def __init__(self, started: int):
        self.started = started
        self.landed = threading.Event()
        self.result = None
        self.failed = False
        self.waiters = 0


class FreshFlights(Generic[T]):
    """Shared runs of reads keyed by what they read (thread-safe; nothing is kept once a flight lands)."""

    def __init__(self):
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self._flying: dict[Hashable, _Flight] = {}

    def run(self, key: Hashable, read: Callable[[], T]) -> T:
        """``read()``'s result from a run of it that began after this call did, shared with the callers of
        the same ``key`` that waited for the same run."""
        with self._lock:
            arrived = next(self._numbers)
        while True:
            with self._lock:
                flight = self._flying.get(key)
                leading = flight is None
                if leading:
                    flight = self._flying[key] = _Flight(next(self._numbers))
                else:
                    flight.waiters += 1
            if leading:
                return self._lead(key, flight, read)
            flight.landed.wait()
            if flight.started > arrived and not flight.failed:
                return flight.result

    def waiting(self, key: Hashable) -> int:
        """How many callers wait for the flight of ``key`` in the air now (0: none in the air)."""
        with self._lock:
            flight = self._flying.get(key)
            return flight.waiters if flight is not None else 0

    def _lead(self, key: Hashable, flight: _Flight, read: Callable[[], T]) -> T:
        try:
            flight.result = read()
        except BaseException:
            flight.failed = True
            raise
        finally:
            with self._lock:
                del self._flying[key]
            flight.landed.set()
        return flight.result
