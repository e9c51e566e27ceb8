"""Builders for the pure core's plain data (no database)."""

from __future__ import annotations

from scheduler.placement import GpuSlot, NodeSlot, Request, Running

H100 = ("H100-80GB", 81920)
L4 = ("L4-24GB", 24576)


def node(name: str, count: int = 8, model=H100, *, reservation: str = "any", schedulable: bool = True) -> NodeSlot:
    return NodeSlot(
        name=name,
        schedulable=schedulable,
        gpus=[
            GpuSlot(uuid=f"{name}-g{i}", node=name, model=model[0], memory_mb=model[1], reservation=reservation)
            for i in range(count)
        ],
    )


def fleet(*specs) -> list[NodeSlot]:
    return [node(*spec) if isinstance(spec, tuple) else node(spec) for spec in specs]


def ded(job_id: int, count: int = 1, *, tenant: str = "a", rank: int = 200, at: int = 0, **kw) -> Request:
    return Request(
        job_id=job_id,
        tenant=tenant,
        rank=rank,
        submitted_ms=at or job_id,
        shared=False,
        count=count,
        priority=kw.pop("priority", "standard"),
        **kw,
    )


def shr(job_id: int, milli: int = 250, *, tenant: str = "a", rank: int = 300, at: int = 0, **kw) -> Request:
    return Request(
        job_id=job_id,
        tenant=tenant,
        rank=rank,
        submitted_ms=at or job_id,
        shared=True,
        share_milli=milli,
        priority=kw.pop("priority", "serving"),
        **kw,
    )


def running(
    job_id: int,
    node: str,
    gpus: list[int],
    *,
    share: int = 1000,
    tenant: str = "z",
    rank: int = 100,
    started: int = 0,
    end: float = 10_000_000,
    priority: str = "preemptible",
    preemptible: bool = True,
    **kw,
) -> Running:
    return Running(
        job_id=job_id,
        tenant=tenant,
        rank=rank,
        node=node,
        gpu_uuids=tuple(f"{node}-g{i}" for i in gpus),
        share_milli=share,
        started_ms=started,
        end_ms=end,
        priority=priority,
        preemptible=preemptible,
        **kw,
    )
