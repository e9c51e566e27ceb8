"""The pure scheduling core: plain data in, decisions out. No Django, no Celery.

Units: GPU shares in thousandths (``1000`` is a whole GPU), memory in MiB,
times in integer milliseconds. The service layer (``scheduler.services``)
reads the state from the database, calls :func:`plan`, and writes the
decisions in one transaction; benchmarks and the operator console's what-if
preview call :func:`plan` directly.
"""

from . import native

native.install()  # the compiled core when a current build exists (before any module of it is imported)

from .core import Session, plan, queue_order  # noqa: E402
from .data import (  # noqa: E402
    ANY,
    DEDICATED_ONLY,
    NEVER,
    SHARED_ONLY,
    WHOLE,
    GpuSlot,
    Limits,
    NodeSlot,
    Placement,
    Plan,
    Policy,
    Preemption,
    Request,
    Running,
)
from .fairshare import standing, usage_accumulate, usage_decay  # noqa: E402

__all__ = [
    "ANY",
    "DEDICATED_ONLY",
    "NEVER",
    "SHARED_ONLY",
    "WHOLE",
    "GpuSlot",
    "Limits",
    "NodeSlot",
    "Placement",
    "Plan",
    "Policy",
    "Preemption",
    "Request",
    "Running",
    "Session",
    "plan",
    "queue_order",
    "standing",
    "usage_accumulate",
    "usage_decay",
]
