"""What the API answers, as typed, frozen dataclasses.

Each keeps the answer it was read from in ``raw`` (the CLI prints that with
``-o json``), so a field the platform adds later is never lost. Money is
``Decimal`` (the API sends exact decimal strings), times are aware ``datetime``
in UTC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

FINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "lost"})


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _money(value) -> Decimal:
    return Decimal(str(value if value is not None else 0))


@dataclass(frozen=True)
class JobUsage:
    gpu_seconds: float = 0.0
    sm_util_avg: float | None = None
    memory_peak_mb: int = 0
    energy_wh: float = 0.0


@dataclass(frozen=True)
class Job:
    id: int
    state: str
    kind: str
    gpus: float
    name: str = ""
    mode: str = ""
    pending_reason: str = ""
    queue_position: int | None = None
    estimated_start: datetime | None = None
    priority: str = ""
    node: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    isolation: str | None = None
    command: tuple[str, ...] = ()
    image: str = ""
    gpu_model: str = ""
    max_runtime_seconds: int | None = None
    submitted_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = None
    stop_reason: str = ""
    preemption_count: int = 0
    cost: Decimal = Decimal(0)
    usage: JobUsage = field(default_factory=JobUsage)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        """Ended for good (succeeded, failed, cancelled or lost); a preempted job is requeued."""
        return self.state in FINAL_STATES

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> Job:
        usage = body.get("usage") or {}
        return cls(
            id=int(body["id"]),
            state=body["state"],
            kind=body.get("kind", ""),
            gpus=body.get("gpus", 0),
            name=body.get("name") or "",
            mode=body.get("mode") or "",
            pending_reason=body.get("pending_reason") or "",
            queue_position=body.get("queue_position"),
            estimated_start=_time(body.get("estimated_start")),
            priority=body.get("priority") or "",
            node=body.get("node"),
            gpu_uuids=tuple(body.get("gpu_uuids") or ()),
            isolation=body.get("isolation"),
            command=tuple(body.get("command") or ()),
            image=body.get("image") or "",
            gpu_model=body.get("gpu_model") or "",
            max_runtime_seconds=body.get("max_runtime_seconds"),
            submitted_at=_time(body.get("submitted_at")),
            started_at=_time(body.get("started_at")),
            finished_at=_time(body.get("finished_at")),
            exit_code=body.get("exit_code"),
            stop_reason=body.get("stop_reason") or "",
            preemption_count=body.get("preemption_count") or 0,
            cost=_money(body.get("cost", 0)),
            usage=JobUsage(
                gpu_seconds=usage.get("gpu_seconds") or 0.0,
                sm_util_avg=usage.get("sm_util_avg"),
                memory_peak_mb=usage.get("memory_peak_mb") or 0,
                energy_wh=usage.get("energy_wh") or 0.0,
            ),
            raw=body,
        )


@dataclass(frozen=True)
class JobArray:
    """A job array (``submit(array=...)``): its tasks are jobs, listed by ``Client.jobs(array=id)``."""

    id: int
    task_count: int
    name: str = ""
    indices: str = ""
    states: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> JobArray:
        return cls(
            id=int(body["id"]),
            task_count=int(body.get("task_count") or 0),
            name=body.get("name") or "",
            indices=str(body.get("indices") or ""),
            states=dict(body.get("states") or {}),
            raw=body,
        )


@dataclass(frozen=True)
class Submission:
    """What ``submit`` got back and whether this call created it.

    ``created`` is False when the Idempotency-Key had already created it (a
    retried CI step): the same job (or array) comes back and nothing new runs.
    A single job is ``job``; a job array is ``array`` (and ``job`` raises).
    """

    created: bool
    single: Job | None = None
    array: JobArray | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def job(self) -> Job:
        if self.single is None:
            raise ValueError("a job array: see .array and Client.jobs(array=...)")
        return self.single

    @classmethod
    def from_api(cls, body: dict[str, Any], *, created: bool) -> Submission:
        if "task_count" in body:  # the API answers an array submission with the array
            return cls(created=created, array=JobArray.from_api(body), raw=body)
        return cls(created=created, single=Job.from_api(body), raw=body)


@dataclass(frozen=True)
class LogPage:
    job: int
    offset: int
    next_offset: int
    data: str
    complete: bool


@dataclass(frozen=True)
class Replica:
    id: int
    job: int
    state: str
    version: int
    node: str | None = None
    port: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> Replica:
        return cls(
            id=int(body["id"]),
            job=int(body["job"]),
            state=body["state"],
            version=int(body.get("version") or 0),
            node=body.get("node"),
            port=body.get("port"),
            raw=body,
        )


@dataclass(frozen=True)
class Endpoint:
    id: int
    name: str
    state: str
    version: int
    url: str
    gpus: float
    min_replicas: int
    max_replicas: int
    replicas: tuple[Replica, ...] = ()
    cost: Decimal = Decimal(0)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ready(self) -> int:
        return sum(r.state == "ready" for r in self.replicas)

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> Endpoint:
        return cls(
            id=int(body["id"]),
            name=body["name"],
            state=body.get("state", ""),
            version=int(body.get("version") or 0),
            url=body.get("url") or "",
            gpus=body.get("gpus", 0),
            min_replicas=int(body.get("min_replicas") or 0),
            max_replicas=int(body.get("max_replicas") or 0),
            replicas=tuple(Replica.from_api(r) for r in body.get("replicas") or ()),
            cost=_money(body.get("cost", 0)),
            raw=body,
        )


@dataclass(frozen=True)
class UsageRow:
    held_gpu_seconds: Decimal
    used_gpu_seconds: Decimal
    cost: Decimal
    day: str | None = None
    job: int | None = None
    gpu_model: str | None = None

    @classmethod
    def from_api(cls, body: dict[str, Any]) -> UsageRow:
        return cls(
            held_gpu_seconds=Decimal(str(body.get("held_gpu_seconds", 0))),
            used_gpu_seconds=Decimal(str(body.get("used_gpu_seconds", 0))),
            cost=Decimal(str(body.get("cost", 0))),
            day=body.get("day"),
            job=body.get("job"),
            gpu_model=body.get("gpu_model"),
        )


@dataclass(frozen=True)
class Usage:
    group_by: str | None
    rows: tuple[UsageRow, ...]
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def cost(self) -> Decimal:
        return sum((r.cost for r in self.rows), Decimal(0))


# --- what ``watch`` yields -------------------------------------------------------------


@dataclass(frozen=True)
class StateChanged:
    """The job's state (or its place in the queue) changed; the first event is the job as found."""

    job: Job


@dataclass(frozen=True)
class LogText:
    """New output of the job, in order."""

    text: str


@dataclass(frozen=True)
class Outage:
    """The platform stopped answering (after the client's own retries); the job runs on regardless."""

    error: Exception


@dataclass(frozen=True)
class Recovered:
    """The platform answers again after an outage."""


@dataclass(frozen=True)
class Finished:
    """The job ended (or was preempted and not requeued in time); always the last event."""

    job: Job


WatchEvent = StateChanged | LogText | Outage | Recovered | Finished
