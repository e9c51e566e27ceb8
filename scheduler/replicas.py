"""What the scheduler asks of the endpoints app (above it: ``.importlinter``), which provides it at start-up.

Defragmentation may move a replica of an endpoint that has more than one serving replica
(:mod:`scheduler.placement.defrag`); only the endpoints app knows which jobs are replicas.
"""

from __future__ import annotations

from gpushare.ports import Port

endpoint_replicas = Port(
    "scheduler.endpoint_replicas",
    "endpoint_replicas(job_ids) -> {job_id: (endpoint_id, serving replicas of that endpoint)}: for the jobs "
    "among job_ids that are live endpoint replicas",
)
