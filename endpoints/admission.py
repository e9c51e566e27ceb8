"""What endpoints ask of the admission layer (``admission/``), which provides it at start-up."""

from __future__ import annotations

from gpushare.ports import Port

endpoint_admit = Port(
    "endpoints.endpoint_admit",
    "endpoint_admit(*, tenant, endpoint_id, gpu_milli, gpu_model, priority, max_replicas) -> None: raise "
    "EndpointError unless the tenant may have this endpoint (counts, replicas, the money hold of its max "
    "replicas over the billing horizon); inside the create/update transaction",
)
