"""A bounded in-process cache that several threads of a web process share: cachetools' LRU behind a lock.

Used where a web process keeps an answer it can check or rebuild (the job list pages it serves, the API
root's links, content negotiation's answers): least recently used out first once ``maxsize`` is passed
(in items, or in whatever ``getsizeof`` measures); an entry larger than the whole cache is not kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from cachetools import LRUCache


class LockedLRU:
    def __init__(self, maxsize: int, getsizeof: Callable[[object], int] | None = None):
        self._items: LRUCache = LRUCache(maxsize=max(1, maxsize), getsizeof=getsizeof)
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        with self._lock:
            return self._items.get(key)

    def put(self, key: Hashable, value) -> None:
        with self._lock:
            if self._items.getsizeof(value) <= self._items.maxsize:
                self._items[key] = value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
