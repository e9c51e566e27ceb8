"""The console's writes: each one delegates to the owning app's service and is audited.

Every function is one transaction, and the audit row (accounts.services.audit_record)
is written in that same transaction, with who, what, before and after.
"""

from __future__ import annotations

from django.db import transaction
from django_scopes import scopes_disabled

from accounts.services import audit_record
from agents.models import Node
from scheduler import services as scheduler_services
from scheduler.models import ACTIVE_STATES, TERMINAL_STATES, Job, JobEvent, JobState, PriorityClass

from .rules import ClassDraft, RuleSet, rule_changes, rules_problems


class ConsoleError(Exception):
    """An operator request the rules refuse; the message says which rule."""


# --- nodes -----------------------------------------------------------------

_NODE_TARGET = {
    "cordon": Node.State.CORDONED,
    "drain": Node.State.DRAINING,
    "uncordon": Node.State.UP,
}
_NODE_FROM = {
    "cordon": {Node.State.UP, Node.State.DRAINING},
    "drain": {Node.State.UP, Node.State.CORDONED},
    "uncordon": {Node.State.CORDONED, Node.State.DRAINING},
}


@scopes_disabled()
@transaction.atomic
def _node_set(*, node: Node, actor, action: str, reason: str) -> Node:
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state not in _NODE_FROM[action]:
        allowed = ", ".join(sorted(_NODE_FROM[action]))
        raise ConsoleError(f"node {node.name} is {node.state}: {action} applies to a node that is {allowed}")
    before = {"state": node.state, "state_reason": node.state_reason}
    node.state = _NODE_TARGET[action]
    who = getattr(actor, "username", "") or "the operator"
    node.state_reason = "" if action == "uncordon" else reason or f"{action} by {who}"
    if action == "drain" and not node.jobs.filter(state__in=ACTIVE_STATES).exists():
        node.state = Node.State.CORDONED  # nothing to wait for
    node.save(update_fields=["state", "state_reason"])
    audit_record(
        actor=actor,
        tenant=None,
        action=f"node.{action}",
        target=node.name,
        before=before,
        after={"state": node.state, "state_reason": node.state_reason},
    )
    if action == "uncordon":
        scheduler_services.schedule_soon()
    return node


def node_cordon(*, node: Node, actor, reason: str = "") -> Node:
    """No new jobs on the node; what runs there keeps running."""
    return _node_set(node=node, actor=actor, action="cordon", reason=reason)


def node_drain(*, node: Node, actor, reason: str = "") -> Node:
    """No new jobs; the node becomes cordoned once its last job ends."""
    return _node_set(node=node, actor=actor, action="drain", reason=reason)


def node_uncordon(*, node: Node, actor, reason: str = "") -> Node:
    """Back in the pool: the next pass may place jobs there."""
    return _node_set(node=node, actor=actor, action="uncordon", reason=reason)


# --- jobs ------------------------------------------------------------------


def _job_snapshot(job: Job) -> dict:
    return {"state": job.state, "priority": job.priority.name, "stop_requested": job.stop_requested}


@transaction.atomic
def job_cancel(*, job: Job, actor, reason: str = "") -> Job:
    """Cancel a job for the operator (scheduler.services.job_cancel), audited."""
    with scopes_disabled():
        job = Job.objects.select_related("priority", "tenant").get(pk=job.pk)
        if job.state in TERMINAL_STATES:
            raise ConsoleError(f"job {job.pk} is already {job.state}: only a job not yet finished can be cancelled")
        before = _job_snapshot(job)
        who = getattr(actor, "username", "") or "the operator"
        job = scheduler_services.job_cancel(job=job, actor=actor, reason=reason or f"cancelled by operator {who}")
        audit_record(
            actor=actor, tenant=job.tenant, action="job.cancel", target=f"job {job.pk}",
            before=before, after=_job_snapshot(job),
        )
    return job


@transaction.atomic
def job_priority_change(*, job: Job, priority: PriorityClass, actor) -> Job:
    """Move a queued job to another priority class; the next pass orders it by its new rank."""
    with scopes_disabled():
        job = Job.objects.select_for_update().select_related("priority", "tenant").get(pk=job.pk)
        if job.state != JobState.QUEUED:
            raise ConsoleError(f"job {job.pk} is {job.state}: only a queued job can change class")
        if job.priority_id == priority.pk:
            return job
        before = _job_snapshot(job)
        old = job.priority.name
        job.priority = priority
        job.save(update_fields=["priority"])
        JobEvent.objects.create(
            tenant_id=job.tenant_id, job=job, from_state=job.state, to_state=job.state,
            detail=f"class changed from {old} to {priority.name} by the operator",
        )
        audit_record(
            actor=actor, tenant=job.tenant, action="job.priority_change", target=f"job {job.pk}",
            before=before, after=_job_snapshot(job),
        )
    scheduler_services.schedule_soon()
    return job



# --- priority rules ----------------------------------------------------------


@transaction.atomic
def rules_apply(*, current: RuleSet, proposed: RuleSet, actor) -> int:
    """Write the proposed rules (after the operator saw their preview); one audit row per changed item."""
    problems = rules_problems(proposed)
    if problems:
        raise ConsoleError("; ".join(problems))
    changes = rule_changes(current, proposed)
    by_name = {c.name: c for c in PriorityClass.objects.select_for_update().prefetch_related("may_preempt")}
    before = current.by_name()
    for draft in proposed.classes:
        if before.get(draft.name) == draft:
            continue
        priority_class = by_name.get(draft.name)
        if priority_class is None:
            raise ConsoleError(f"class {draft.name} no longer exists: reload the page")
        priority_class_update(priority_class=priority_class, draft=draft, actor=actor)
    return len(changes)


def priority_class_update(*, priority_class: PriorityClass, draft: ClassDraft, actor) -> PriorityClass:
    before_snapshot = {
        "rank": priority_class.rank,
        "preemptible": priority_class.preemptible,
        "may_preempt": sorted(p.name for p in priority_class.may_preempt.all()),
        "min_runtime_s": priority_class.min_runtime_s,
        "grace_period_s": priority_class.grace_period_s,
        "price_multiplier": str(priority_class.price_multiplier),
        "default_for_kind": priority_class.default_for_kind,
    }
    for name in ("rank", "preemptible", "min_runtime_s", "grace_period_s", "price_multiplier", "default_for_kind"):
        setattr(priority_class, name, getattr(draft, name))
    priority_class.save()
    priority_class.may_preempt.set(PriorityClass.objects.filter(name__in=draft.may_preempt))
    audit_record(
        actor=actor, tenant=None, action="priority_class.update", target=priority_class.name,
        before=before_snapshot, after=draft.snapshot(),
    )
    scheduler_services.schedule_soon()
    return priority_class
