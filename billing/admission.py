"""What billing's estimate asks of the admission layer (``admission/``), which provides it at start-up."""

from __future__ import annotations

from gpushare.ports import Port

hold_preview = Port(
    "billing.hold_preview",
    "hold_preview(*, tenant, mode, gpu_milli, gpu_model, max_runtime_s, multiplier) -> HoldPreview: what "
    "submitting this job would hold against the tenant's budget, and whether it fits",
)
