"""What a GPU health event means (pure: shared by the agent and the platform).

XIDs 13, 31, 43, 45, 68 and 109 are application errors: the job that caused
them fails, the GPU stays in service. Every other XID, an uncorrectable (double
bit) ECC error, a pending row remap, or an event-wait failure takes the GPU out
of service until the operator returns it.
"""

from __future__ import annotations

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# Event kinds the agent reports in ``agents.gpu_health``.
XID = "xid"
ECC_DOUBLE_BIT = "ecc_double_bit"
ECC_SINGLE_BIT = "ecc_single_bit"
ROW_REMAP = "row_remap_pending"
GPU_LOST = "gpu_lost"


def event_is_application_error(event: dict) -> bool:
    return event.get("kind") == XID and int(event.get("xid", -1)) in APPLICATION_XIDS


def event_takes_gpu_out(event: dict) -> bool:
    """Whether the GPU must leave the pool (corrected single-bit ECC errors do not)."""
    kind = event.get("kind")
    if kind == XID:
        return not event_is_application_error(event)
    return kind in (ECC_DOUBLE_BIT, ROW_REMAP, GPU_LOST)


def event_describe(event: dict) -> str:
    kind = event.get("kind")
    if kind == XID:
        what = "application error" if event_is_application_error(event) else "hardware/driver error"
        return f"XID {event.get('xid')} ({what})"
    return {
        ECC_DOUBLE_BIT: "uncorrectable (double-bit) ECC error",
        ECC_SINGLE_BIT: "corrected (single-bit) ECC error",
        ROW_REMAP: "memory row remap pending",
        GPU_LOST: "GPU fell off the bus / is lost",
    }.get(kind, f"health event {kind!r}")
