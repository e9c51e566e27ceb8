"""The pure scheduling core: plain data in, decisions out. No Django, no Celery.

Units: GPU shares in thousandths (``1000`` is a whole GPU), memory in MiB,
times in integer milliseconds. The service layer (``scheduler.services``)
reads the state from the database, calls :func:`plan`, and writes the
decisions in one transaction; benchmarks and the operator console's what-if
preview call :func:`plan` directly.
"""

from .core import Session, plan, queue_order
from .data import (
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
from .fairshare import standing, usage_accumulate, usage_decay

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
