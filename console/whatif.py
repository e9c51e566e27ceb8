"""What-if preview: replay recorded submissions through the pure scheduler core.

Plain Python, no Django. A small discrete-event simulation: jobs arrive at
their recorded submit times, each scheduling pass asks ``scheduler.placement``
where the queued jobs go on the fleet as it is now, placed jobs run for their
recorded duration, finish and free their GPUs. Run it once with the current
rules and once with the proposed rules, and compare, per tenant and per
priority class: mean and p95 wait, GPU-hours received, preemptions, and the
fleet's utilisation.

Units: shares in thousandths of a GPU, times in integer milliseconds.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from scheduler import placement

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class HistoryJob:
    """One recorded submission, as the replay needs it."""

    job_id: int
    tenant: str
    priority: str  # the class name it was submitted with
    submitted_ms: int
    run_ms: int  # how long it ran (or its max runtime when it never finished)
    shared: bool
    count: int = 1  # whole GPUs when dedicated
    share_milli: int = placement.WHOLE  # slice size when shared
    gpu_model: str = ""
    gpu_memory_mb: int = 0
    max_runtime_ms: int = 0  # what the scheduler assumes for backfill and estimates (0: policy default)

    @property
    def milli(self) -> int:
        return self.share_milli if self.shared else self.count * placement.WHOLE


@dataclass(frozen=True)
class ClassRule:
    name: str
    rank: int
    preemptible: bool = False
    may_preempt: frozenset[str] = frozenset()
    min_runtime_ms: int = 0
    grace_ms: int = 30_000


@dataclass(frozen=True)
class Rules:
    """The rules a replay runs under: classes by name, tenant weights, fair-share half-life."""

    classes: dict[str, ClassRule]
    tenant_weights: dict[str, float] = field(default_factory=dict)
    half_life_ms: int = 7 * 24 * HOUR_MS
    backfill: bool = True
    default_max_runtime_ms: int = 24 * HOUR_MS
    preempt_grace_ms: int = 30_000
    # Tenants' concurrent caps (dedicated GPUs, shared thousandths), as they are now.
    limits: dict[str, placement.Limits] = field(default_factory=dict)
    # Price of a dedicated GPU-hour per model, as the scheduler's pass reads it (the placement score's
    # price term: the cheapest fitting model first for a job that names none).
    model_price: dict[str, float] = field(default_factory=dict)

    def class_of(self, job: HistoryJob) -> str:
        return job.priority

    def rule_of(self, job: HistoryJob) -> ClassRule:
        name = self.class_of(job)
        return self.classes.get(name) or ClassRule(name, 0)


@dataclass
class JobOutcome:
    job_id: int
    tenant: str
    priority: str
    submitted_ms: int
    start_ms: int | None = None  # first start
    end_ms: int | None = None
    held_gpu_ms: int = 0
    preemptions: int = 0
    unplaceable: str = ""  # why it could never start on this fleet

    @property
    def wait_ms(self) -> int | None:
        return None if self.start_ms is None else self.start_ms - self.submitted_ms


@dataclass
class Stats:
    jobs: int = 0
    started: int = 0
    mean_wait_s: float | None = None
    p95_wait_s: float | None = None
    gpu_hours: float = 0.0
    preemptions: int = 0


@dataclass
class Replay:
    outcomes: dict[int, JobOutcome]
    per_tenant: dict[str, Stats]
    per_class: dict[str, Stats]
    utilisation: float  # held GPU-time / fleet GPU-time over the window, 0..1
    window_start_ms: int
    window_end_ms: int
    passes: int


def p95(values: list[float]) -> float | None:
    """95th percentile by nearest rank (the value 95% of the sample is at or below)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def fleet_copy(nodes: list[placement.NodeSlot]) -> list[placement.NodeSlot]:
    """The same nodes and GPUs, with nothing held on them."""
    return [
        placement.NodeSlot(
            name=n.name,
            schedulable=n.schedulable,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            gpus=[
                placement.GpuSlot(
                    uuid=g.uuid,
                    node=g.node,
                    model=g.model,
                    memory_mb=g.memory_mb,
                    reservation=g.reservation,
                    healthy=g.healthy,
                    mig=g.mig,
                )
                for g in n.gpus
            ],
        )
        for n in nodes
    ]


def _request(job: HistoryJob, rules: Rules) -> placement.Request:
    rule = rules.rule_of(job)
    return placement.Request(
        job_id=job.job_id,
        tenant=job.tenant,
        rank=rule.rank,
        submitted_ms=job.submitted_ms,
        shared=job.shared,
        count=1 if job.shared else job.count,
        share_milli=job.share_milli if job.shared else placement.WHOLE,
        gpu_model=job.gpu_model,
        gpu_memory_mb=job.gpu_memory_mb,
        max_runtime_ms=job.max_runtime_ms,
        priority=rule.name,
    )


def policy_for(rules: Rules, *, now_ms: int, usage: dict[str, float]) -> placement.Policy:
    return placement.Policy(
        now_ms=now_ms,
        weights=dict(rules.tenant_weights),
        usage=dict(usage),
        half_life_ms=rules.half_life_ms,
        may_preempt={name: rule.may_preempt for name, rule in rules.classes.items() if rule.may_preempt},
        backfill=rules.backfill,
        default_max_runtime_ms=rules.default_max_runtime_ms,
        preempt_grace_ms=rules.preempt_grace_ms,
        limits=dict(rules.limits),
        model_price=dict(rules.model_price),
    )


@dataclass
class _Run:
    """A job holding GPUs in the replay."""

    job: HistoryJob
    node: str
    gpu_uuids: tuple[str, ...]
    share_milli: int
    started_ms: int
    attempt: int
    stopping: bool = False


ARRIVE, FINISH, STOPPED = 0, 1, 2


def simulate(
    *,
    history: list[HistoryJob],
    nodes: list[placement.NodeSlot],
    rules: Rules,
    window_start_ms: int | None = None,
    window_end_ms: int | None = None,
    horizon_ms: int = 7 * 24 * HOUR_MS,
) -> Replay:
    """Replay ``history`` on ``nodes`` (taken empty) under ``rules``.

    A pass runs at every arrival, finish and preempted job's exit, as the real
    scheduler's ``schedule_soon`` does. A preempted job exits at the end of its
    class's grace period, goes back to the queue with its original submit time
    and runs its whole duration again (no checkpoint is assumed). The replay
    stops when every job has finished, or ``horizon_ms`` after the window's end
    (jobs still waiting then count as not started).
    """
    start = window_start_ms if window_start_ms is not None else min((j.submitted_ms for j in history), default=0)
    end = window_end_ms if window_end_ms is not None else max((j.submitted_ms for j in history), default=start)
    stop_at = end + horizon_ms
    outcomes = {j.job_id: JobOutcome(j.job_id, j.tenant, rules.class_of(j), j.submitted_ms) for j in history}
    never: dict[tuple, str] = {}  # request shape -> why it cannot start even on the empty fleet ("" if it can)
    for job in history:
        request = _request(job, rules)
        if request.shape() not in never:
            trial = placement.plan(fleet_copy(nodes), [request], policy=policy_for(rules, now_ms=0, usage={}))
            never[request.shape()] = "" if trial.placements else trial.pending.get(job.job_id, "does not fit")
        outcomes[job.job_id].unplaceable = never[request.shape()]

    events: list[tuple[int, int, int, int]] = []  # (at, kind, job id, attempt)
    for job in history:
        if not outcomes[job.job_id].unplaceable:
            heapq.heappush(events, (job.submitted_ms, ARRIVE, job.job_id, 0))
    jobs = {j.job_id: j for j in history}
    queue: dict[int, HistoryJob] = {}
    running: dict[int, _Run] = {}
    attempts: dict[int, int] = {}
    usage: dict[str, float] = {}
    held: dict[str, int] = {}
    clock = start
    passes = 0
    held_in_window = 0

    def advance(to: int) -> None:
        nonlocal clock
        if to > clock:
            for tenant in set(usage) | set(held):
                usage[tenant] = placement.usage_accumulate(
                    usage.get(tenant, 0.0),
                    milli=held.get(tenant, 0),
                    duration_ms=to - clock,
                    half_life_ms=rules.half_life_ms,
                )
            clock = to

    def release(job_id: int, at: int) -> None:
        nonlocal held_in_window
        run = running.pop(job_id)
        milli = run.share_milli * len(run.gpu_uuids)
        held[run.job.tenant] -= milli
        outcomes[job_id].held_gpu_ms += (at - run.started_ms) * milli // placement.WHOLE
        held_in_window += max(0, min(at, end) - max(run.started_ms, start)) * milli // placement.WHOLE
        outcomes[job_id].end_ms = at

    while events:
        now = events[0][0]
        if now > stop_at:
            break
        advance(now)
        while events and events[0][0] == now:
            _, kind, job_id, attempt = heapq.heappop(events)
            if kind == ARRIVE:
                queue[job_id] = jobs[job_id]
            elif job_id in running and running[job_id].attempt == attempt:
                release(job_id, now)
                if kind == STOPPED:
                    outcomes[job_id].preemptions += 1
                    queue[job_id] = jobs[job_id]
        if not queue:
            continue
        passes += 1
        decided = placement.plan(
            fleet_copy(nodes),
            [_request(j, rules) for j in queue.values()],
            # newest submission first, as scheduler.passes lists them (the core breaks ties by this order)
            running=[
                _running(run, rules)
                for run in sorted(running.values(), key=lambda r: (-r.job.submitted_ms, -r.job.job_id))
            ],
            policy=policy_for(rules, now_ms=now, usage=usage),
        )
        for decision in decided.placements:
            job = queue.pop(decision.job_id)
            attempts[job.job_id] = attempts.get(job.job_id, 0) + 1
            run = _Run(job, decision.node, decision.gpu_uuids, decision.share_milli, now, attempts[job.job_id])
            running[job.job_id] = run
            held[job.tenant] = held.get(job.tenant, 0) + decision.share_milli * len(decision.gpu_uuids)
            outcome = outcomes[job.job_id]
            if outcome.start_ms is None:
                outcome.start_ms = now
            heapq.heappush(events, (now + max(1, job.run_ms), FINISH, job.job_id, run.attempt))
        for preemption in decided.preemptions:
            victim = running.get(preemption.victim_id)
            if victim is None or victim.stopping:
                continue
            victim.stopping = True
            grace = rules.rule_of(victim.job).grace_ms
            if now + grace < victim.started_ms + victim.job.run_ms:  # else it finishes on its own first
                heapq.heappush(events, (now + grace, STOPPED, victim.job.job_id, victim.attempt))

    for job_id in list(running):
        release(job_id, max(running[job_id].started_ms, stop_at))

    fleet_gpus = sum(1 for n in nodes for g in n.gpus if n.schedulable and g.healthy)
    capacity = fleet_gpus * max(1, end - start)
    return Replay(
        outcomes=outcomes,
        per_tenant=_stats(outcomes, key=lambda o: o.tenant),
        per_class=_stats(outcomes, key=lambda o: o.priority),
        utilisation=held_in_window / capacity if capacity else 0.0,
        window_start_ms=start,
        window_end_ms=end,
        passes=passes,
    )


def _running(run: _Run, rules: Rules) -> placement.Running:
    rule = rules.rule_of(run.job)
    runtime = run.job.max_runtime_ms or rules.default_max_runtime_ms
    return placement.Running(
        job_id=run.job.job_id,
        tenant=run.job.tenant,
        rank=rule.rank,
        node=run.node,
        gpu_uuids=run.gpu_uuids,
        share_milli=run.share_milli,
        started_ms=run.started_ms,
        end_ms=run.started_ms + runtime,
        priority=rule.name,
        preemptible=rule.preemptible,
        min_runtime_ms=rule.min_runtime_ms,
        gpu_memory_mb=run.job.gpu_memory_mb if run.job.shared else 0,
        stopping=run.stopping,
    )


def _stats(outcomes: dict[int, JobOutcome], *, key) -> dict[str, Stats]:
    groups: dict[str, list[JobOutcome]] = defaultdict(list)
    for outcome in outcomes.values():
        groups[key(outcome)].append(outcome)
    result = {}
    for name, members in sorted(groups.items()):
        waits = [o.wait_ms / 1000 for o in members if o.wait_ms is not None]
        result[name] = Stats(
            jobs=len(members),
            started=len(waits),
            mean_wait_s=sum(waits) / len(waits) if waits else None,
            p95_wait_s=p95(waits),
            gpu_hours=sum(o.held_gpu_ms for o in members) / HOUR_MS,
            preemptions=sum(o.preemptions for o in members),
        )
    return result


@dataclass
class Row:
    """One line of the side-by-side table."""

    group: str  # "tenant" or "class"
    name: str
    before: Stats
    after: Stats

    @property
    def mean_wait_change_s(self) -> float | None:
        if self.before.mean_wait_s is None or self.after.mean_wait_s is None:
            return None
        return self.after.mean_wait_s - self.before.mean_wait_s


@dataclass
class Comparison:
    before: Replay
    after: Replay
    rows: list[Row]
    jobs: int
    unplaceable: int


def compare(
    *,
    history: list[HistoryJob],
    nodes: list[placement.NodeSlot],
    current: Rules,
    proposed: Rules,
    window_start_ms: int | None = None,
    window_end_ms: int | None = None,
) -> Comparison:
    """Replay the same history under the current and the proposed rules."""
    kwargs = {"history": history, "nodes": nodes, "window_start_ms": window_start_ms, "window_end_ms": window_end_ms}
    before = simulate(rules=current, **kwargs)
    after = simulate(rules=proposed, **kwargs)
    rows = []
    for group, attr in (("tenant", "per_tenant"), ("class", "per_class")):
        b, a = getattr(before, attr), getattr(after, attr)
        for name in sorted(set(b) | set(a)):
            rows.append(Row(group, name, b.get(name, Stats()), a.get(name, Stats())))
    unplaceable = sum(1 for o in after.outcomes.values() if o.unplaceable)
    return Comparison(before=before, after=after, rows=rows, jobs=len(history), unplaceable=unplaceable)


def comparison_to_data(comparison: Comparison) -> dict:
    """The side-by-side table as plain JSON-able data, shaped like the Comparison the page renders."""

    def stats(s: Stats) -> dict:
        return {
            "jobs": s.jobs,
            "started": s.started,
            "mean_wait_s": s.mean_wait_s,
            "p95_wait_s": s.p95_wait_s,
            "gpu_hours": s.gpu_hours,
            "preemptions": s.preemptions,
        }

    return {
        "jobs": comparison.jobs,
        "unplaceable": comparison.unplaceable,
        "before": {"utilisation": comparison.before.utilisation},
        "after": {"utilisation": comparison.after.utilisation},
        "rows": [
            {
                "group": r.group,
                "name": r.name,
                "before": stats(r.before),
                "after": stats(r.after),
                "mean_wait_change_s": r.mean_wait_change_s,
            }
            for r in comparison.rows
        ],
    }
