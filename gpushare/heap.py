"""The objects a process makes while it starts, out of the garbage collector's reach (``gc.freeze``).

A Django process holds ~140,000 objects the collector tracks once its apps, URL patterns and first
requests are loaded: modules, classes, functions, settings, compiled patterns, nearly all of them for
the process's life. CPython's oldest-generation collection walks every one of them: 70-180 ms each
on the bench machine, during which that process's requests or tasks wait. In 75 s of the bench's
submit rounds the web's workers ran three, of 70, 141 and 24 ms (docs/benchmarks.md, session 28).
Frozen, those objects are never walked again, and a full collection walks only what was made since.
Frozen objects are never collected as cycles (reference counting still frees them): only what exists
when the process is ready is frozen, after a collection has taken its garbage.
"""

from __future__ import annotations

import gc


def heap_settle() -> None:
    """Collect, then freeze what is left: call once the process has loaded what it keeps (for the web,
    its URL conf too), before it serves."""
    gc.collect()
    gc.freeze()
