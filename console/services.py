"""The console's writes: each one delegates to the owning app's service and is audited.

Every function is one transaction, and the audit row (accounts.services.audit_record)
is written in that same transaction, with who, what, before and after.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db import transaction
from django_scopes import scopes_disabled

from accounts.models import Plan, Tenant
from accounts.services import audit_record
from agents.models import Node
from billing.models import Price
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
        priority_class_save(priority_class=priority_class, draft=draft, actor=actor)
    return len(changes)


def _class_snapshot(priority_class: PriorityClass) -> dict:
    return {
        "rank": priority_class.rank,
        "preemptible": priority_class.preemptible,
        "may_preempt": sorted(p.name for p in priority_class.may_preempt.all()),
        "min_runtime_s": priority_class.min_runtime_s,
        "grace_period_s": priority_class.grace_period_s,
        "price_multiplier": str(priority_class.price_multiplier),
        "default_for_kind": priority_class.default_for_kind,
    }


@transaction.atomic
def priority_class_save(*, priority_class: PriorityClass | None, draft: ClassDraft, actor) -> PriorityClass:
    """Create (``priority_class=None``) or update a class from a draft already checked by rules_problems."""
    if priority_class is not None:  # the caller's instance may already carry the form's values: read the row
        priority_class = PriorityClass.objects.select_for_update().get(pk=priority_class.pk)
    before = _class_snapshot(priority_class) if priority_class else None
    priority_class = priority_class or PriorityClass(name=draft.name)
    priority_class.name = draft.name
    for name in ("rank", "preemptible", "min_runtime_s", "grace_period_s", "price_multiplier", "default_for_kind"):
        setattr(priority_class, name, getattr(draft, name))
    priority_class.save()
    priority_class.may_preempt.set(PriorityClass.objects.filter(name__in=draft.may_preempt))
    audit_record(
        actor=actor, tenant=None, action="priority_class.create" if before is None else "priority_class.update",
        target=priority_class.name, before=before, after=_class_snapshot(priority_class),
    )
    scheduler_services.schedule_soon()
    return priority_class


# --- tenants, plans, prices --------------------------------------------------------


def _plain(value):
    return value if value is None or isinstance(value, bool | int | str) else str(value)


@scopes_disabled()
@transaction.atomic
def tenant_profile_update(*, tenant: Tenant, actor, changes: dict) -> Tenant:
    """The operator edits a tenant's name or billing email (state changes go through suspend/reinstate)."""
    allowed = {"name", "billing_email"}
    if set(changes) - allowed:
        raise ConsoleError(f"only {', '.join(sorted(allowed))} can be edited here")
    locked = Tenant.objects.select_for_update().get(pk=tenant.pk)
    before = {name: getattr(locked, name) for name in changes}
    for name, value in changes.items():
        setattr(locked, name, value)
    locked.save(update_fields=list(changes))
    audit_record(actor=actor, tenant=locked, action="tenant.update", target=locked.slug, before=before,
                 after=dict(changes))
    return locked


@transaction.atomic
def plan_save(*, plan: Plan, actor, changed: list[str], created: bool) -> Plan:
    """Save a plan's limits (the tenants on it follow them at their next admission check)."""
    before = None
    if not created:
        old = Plan.objects.select_for_update().get(pk=plan.pk)
        before = {name: _plain(getattr(old, name)) for name in changed}
    plan.full_clean()
    plan.save()
    audit_record(
        actor=actor, tenant=None, action="plan.create" if created else "plan.update", target=plan.name,
        before=before, after={name: _plain(getattr(plan, name)) for name in (changed or ["name"])},
    )
    return plan


@transaction.atomic
def price_add(
    *, gpu_model: str, mode: str, per_gpu_hour: Decimal, currency: str, effective_from: datetime, actor
) -> Price:
    """A new price from a date on. Past prices are never rewritten; usage is rated by the price in force then."""
    if per_gpu_hour < 0:
        raise ConsoleError("a price per GPU-hour is 0 or more")
    previous = (
        Price.objects.filter(gpu_model=gpu_model, mode=mode, effective_from__lte=effective_from)
        .order_by("-effective_from").first()
    )
    if Price.objects.filter(gpu_model=gpu_model, mode=mode, effective_from=effective_from).exists():
        raise ConsoleError(f"{gpu_model} {mode} already has a price from {effective_from:%Y-%m-%d %H:%M}")
    price = Price.objects.create(
        gpu_model=gpu_model, mode=mode, per_gpu_hour=per_gpu_hour, currency=currency, effective_from=effective_from
    )
    audit_record(
        actor=actor, tenant=None, action="price.add", target=f"{gpu_model} {mode}",
        before={"per_gpu_hour": str(previous.per_gpu_hour), "effective_from": previous.effective_from.isoformat()}
        if previous else None,
        after={"per_gpu_hour": str(per_gpu_hour), "currency": currency, "effective_from": effective_from.isoformat()},
    )
    return price
