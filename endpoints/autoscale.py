"""The autoscaling decision (pure: plain numbers in, a replica count out).

Scale up at once to cover the demand seen (in flight + queued at the
gateway) at ``concurrency_target`` requests per replica; scale down only to
what the peak of the last idle-timeout window needed, so a burst's replicas
stay warm for a while; reach zero only after a whole idle timeout without a
request (when ``min_replicas`` is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    inflight: int
    queued: int
    peak: int  # max concurrency (in flight + queued) over the idle timeout
    idle_ms: int | None  # since the last request; None if never
    current: int  # replicas of the current version, starting or ready
    min_replicas: int
    max_replicas: int
    target: int
    idle_timeout_ms: int


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def desired_replicas(load: Load) -> Decision:
    target = max(1, load.target)
    demand = load.inflight + load.queued
    needed_now = math.ceil(demand / target)
    needed_recently = math.ceil(load.peak / target)
    idle = load.idle_ms is None or load.idle_ms >= load.idle_timeout_ms
    if demand == 0 and idle:
        want, why = 0, f"idle for over {load.idle_timeout_ms // 1000} s"
    elif needed_now > load.current:
        want, why = needed_now, f"{demand} request(s) in flight or queued at {target} per replica"
    else:
        want = max(needed_now, needed_recently)
        why = f"peak of {load.peak} concurrent request(s) in the last {load.idle_timeout_ms // 1000} s"
        if want == 0:  # demand, or a request within the idle timeout: zero only by the branch above
            want = 1
    bounded = min(max(want, load.min_replicas), load.max_replicas)
    if bounded != want:
        why += f" (bounded to {load.min_replicas}..{load.max_replicas})"
    return Decision(replicas=bounded, reason=why)
