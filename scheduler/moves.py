"""The scheduling pass's defragmentation step (the decision is pure: :mod:`scheduler.placement.defrag`).

Before the plan, :func:`claims_open` reads the GPUs that earlier moves are freeing for jobs still queued: the
core keeps them for those jobs (``Policy.claims``). After the plan, :func:`defrag_step` gives the pure
decision the jobs left waiting on capacity, the running slices that may move (preemptible, or replicas of
endpoints with more than one serving: asked of the endpoints app through a port) and when each job or
endpoint was last moved; it writes a decided move like a preemption (``stop_requested="move"``: the agent
stops the slice with its class's grace period, the exit queues it again), records it (:class:`JobMove`, an
event in the timeline of every job it touches, a log line) and tells the waiting job's why-pending and
estimated start. All inside the pass's transaction; stop messages go after commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import Max

from . import placement
from .models import ACTIVE_STATES, MILLI_PER_GPU, Job, JobEvent, JobMode, JobMove, JobState, PriorityClass
from .placement.core import CLAIM_WAIT
from .placement.defrag import Defrag, DefragPolicy, Movable, defrag_candidates, defrag_decide

log = logging.getLogger(__name__)

CLAIM_TTL = timedelta(minutes=15)  # a claim whose slices never stopped (a node gone) lapses after this


@dataclass
class Claims:
    """GPUs being freed by moves for jobs still queued."""

    gpus: dict[str, int] = field(default_factory=dict)  # GPU uuid -> the job it is freed for
    waits: dict[int, tuple[str, datetime]] = field(default_factory=dict)  # job -> (why it waits, when free)


def claims_open(now) -> Claims:
    claims = Claims()
    rows = (
        JobMove.objects.filter(for_job__state=JobState.QUEUED, at__gte=now - CLAIM_TTL)
        .order_by("at", "id")
        .values_list("for_job_id", "freed", "node", "free_at")
    )
    moved: dict[int, int] = {}
    for job_id, freed, node, free_at in rows:
        for uuid in freed:
            claims.gpus[uuid] = job_id
        moved[job_id] = moved.get(job_id, 0) + 1
        gpus = sum(1 for owner in claims.gpus.values() if owner == job_id)
        claims.waits[job_id] = (_waiting_reason(moved[job_id], gpus, node), free_at)
    return claims


def _waiting_reason(moved: int, gpus: int, node: str) -> str:
    return f"waiting for {moved} slice(s) moved off {gpus} GPU(s) on {node} to stop: freed for it (defragmentation)"


def defrag_step(
    *,
    decided: placement.Plan,
    nodes: list[placement.NodeSlot],
    requests: list[placement.Request],
    running: list[placement.Running],
    classes: dict[int, PriorityClass],
    conf,
    claims: Claims,
    grace_ms: int,
    now,
) -> Defrag | None:
    """Decide and write at most one move (of one or more slices) for the jobs the plan left waiting; set the
    why-pending and estimated start of the jobs that moves free GPUs for. Returns the move written."""
    now_ms = int(now.timestamp() * 1000)
    for job_id, (reason, free_at) in claims.waits.items():
        if decided.pending.get(job_id) == CLAIM_WAIT:  # not when something else holds it (a tenant limit)
            decided.pending[job_id] = reason
            decided.estimated_start_ms[job_id] = int(free_at.timestamp() * 1000)
    if not conf.defrag:
        return None
    by_id = {r.job_id: r for r in requests}
    waiting = [by_id[j] for j in decided.blocked if j in by_id and j not in claims.waits]
    policy = DefragPolicy(
        now_ms=now_ms,
        min_interval_ms=conf.defrag_min_interval_s * 1000,
        min_gain_ms=conf.defrag_min_gain_s * 1000,
        grace_ms=grace_ms,
    )
    waiting = defrag_candidates(waiting, running, policy=policy, estimates=decided.estimated_start_ms)
    if not waiting:
        return None
    victims = {p.victim_id for p in decided.preemptions}
    slices = [r for r in running if r.share_milli < MILLI_PER_GPU and not r.stopping and r.job_id not in victims]
    if not slices:
        return None
    movable = _movable(slices, classes)
    if not movable:
        return None
    endpoints = {m.endpoint for m in movable.values() if m.endpoint is not None}
    moved_ms = _last_moves("job_id", list(movable))
    endpoint_moved_ms = _last_moves("endpoint_id", list(endpoints)) if endpoints else {}
    decision = defrag_decide(
        nodes,
        waiting,
        running,
        movable,
        policy=policy,
        moved_ms=moved_ms,
        endpoint_moved_ms=endpoint_moved_ms,
        estimates=decided.estimated_start_ms,
        reserved=decided.reserved,
    )
    if decision is None:
        return None
    waiter = decision.for_job_id
    if decision.at_ms > now_ms:  # held back by the disturbance bound: the estimate counts the move to come
        at = datetime.fromtimestamp(decision.at_ms / 1000, tz=UTC)
        why = decided.pending.get(waiter, "")[:120]
        decided.pending[waiter] = f"{why}; slices may be moved for it from {at:%H:%M} UTC (defragmentation)"
        estimate = decided.estimated_start_ms.get(waiter)
        decided.estimated_start_ms[waiter] = min(estimate or decision.start_ms, decision.start_ms)
        return None
    free_at = _moves_write(decision, movable, classes, now)
    if free_at is None:
        return None
    decided.pending[waiter] = _waiting_reason(len(decision.moves), len(decision.gpu_uuids), decision.node)
    decided.estimated_start_ms[waiter] = int(free_at.timestamp() * 1000)
    return decision


def _movable(slices: list[placement.Running], classes: dict[int, PriorityClass]) -> dict[int, Movable]:
    """The running slices that are preemptible or endpoint replicas, with what they ask for when placed again."""
    from .replicas import endpoint_replicas

    others = [r.job_id for r in slices if not r.preemptible]
    replicas = endpoint_replicas(others) if others else {}
    ids = [r.job_id for r in slices if r.preemptible or r.job_id in replicas]
    if not ids:
        return {}
    rows = Job.objects.filter(pk__in=ids).values_list(
        "id", "tenant_id", "priority_id", "submitted_at", "mode", "gpu_milli", "gpu_model", "gpu_memory_mb"
    )
    movable = {}
    for job_id, tenant_id, priority_id, submitted_at, mode, milli, model, memory in rows:
        if mode != JobMode.SHARED:
            continue
        klass = classes[priority_id]
        endpoint, serving = replicas.get(job_id, (None, 0))
        ask = placement.Request(
            job_id=job_id,
            tenant=str(tenant_id),
            rank=klass.rank,
            submitted_ms=int(submitted_at.timestamp() * 1000),
            shared=True,
            share_milli=milli,
            gpu_model=model,
            gpu_memory_mb=memory or 0,
            priority=klass.name,
        )
        movable[job_id] = Movable(ask=ask, endpoint=endpoint, replicas=serving)
    return movable


def _last_moves(column: str, keys: list[int]) -> dict[int, int]:
    """When each job (or endpoint) was last moved, ms."""
    rows = (
        JobMove.objects.filter(**{f"{column}__in": keys})
        .values(column)
        .annotate(last=Max("at"))
        .values_list(column, "last")
    )
    return {key: int(last.timestamp() * 1000) for key, last in rows}


def _moves_write(decision: Defrag, movable: dict[int, Movable], classes, now) -> datetime | None:
    """Ask the agents to stop the moved slices (grace period), record the move; None (nothing written) when a
    slice is no longer there to move (it ended meanwhile)."""
    ids = [m.job_id for m in decision.moves]
    jobs = list(
        Job.objects.select_for_update(of=("self",))
        .filter(pk__in=ids, state__in=ACTIVE_STATES, stop_requested="")
        .select_related("node")
        .order_by("pk")
    )
    if len(jobs) != len(ids):
        return None
    waiter = Job.objects.only("pk", "tenant_id", "state").get(pk=decision.for_job_id)
    where = {m.job_id: m for m in decision.moves}
    free_at = now + timedelta(seconds=max(classes[j.priority_id].grace_period_s for j in jobs))
    messages, events, rows = [], [], []
    for job in jobs:
        grace = classes[job.priority_id].grace_period_s
        reason = f"moved to free GPUs for job {decision.for_job_id} (defragmentation); queued again once stopped"
        job.stop_requested = "move"
        job.stop_reason = reason
        events.append(
            JobEvent(tenant_id=job.tenant_id, job=job, from_state=job.state, to_state=job.state, detail=reason)
        )
        rows.append(
            JobMove(
                tenant_id=job.tenant_id,
                job=job,
                for_job_id=decision.for_job_id,
                endpoint_id=movable[job.pk].endpoint,
                node=job.node.name if job.node else where[job.pk].node,
                gpu_uuid=where[job.pk].gpu_uuid,
                freed=list(decision.gpu_uuids),
                reason=decision.reason[:300],
                at=now,
                free_at=free_at,
            )
        )
        payload = {"job_id": job.pk, "attempt": job.attempt, "reason": reason, "grace_s": grace}
        messages.append((job.node.name, "agent.stop", payload))
    Job.objects.bulk_update(jobs, ["stop_requested", "stop_reason"])
    events.append(
        JobEvent(
            tenant_id=waiter.tenant_id,
            job=waiter,
            from_state=waiter.state,
            to_state=waiter.state,
            detail=decision.reason[:300],
        )
    )
    JobEvent.objects.bulk_create(events)
    JobMove.objects.bulk_create(rows)
    log.info("%s", decision.reason)

    from agents.dispatch import nodes_send

    transaction.on_commit(lambda: nodes_send(messages))
    return free_at
