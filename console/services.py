"""The console's writes: each one delegates to the owning app's service and is audited.

Every function is one transaction, and the audit row (accounts.services.audit_record)
is written in that same transaction, with who, what, before and after.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from accounts.models import Plan, Tenant
from accounts.services import audit_record
from accounts.tenancy import acts_for_tenant, tenant_scope
from agents import services as agent_services
from agents.models import Node
from billing.models import Price
from scheduler import services as scheduler_services
from scheduler.models import TERMINAL_STATES, Job, JobEvent, JobState, PriorityClass
from scheduler.rules import (
    RuleError,
    priority_class_create,
    priority_class_update,
    scheduler_settings_update,
    tenant_weight_set,
)

from . import whatif
from .models import WhatIfRun
from .rules import ClassDraft, RuleSet, rules_problems, ruleset_from_data, ruleset_to_data


class ConsoleError(Exception):
    """An operator request the rules refuse; the message says which rule."""


# --- nodes ---------------------------------------------------------------------
# The agents app owns node states (agents.services); these only turn its refusals into ConsoleError.


def node_cordon(*, node: Node, actor, reason: str = "") -> Node:
    """No new jobs on the node; what runs there keeps running."""
    try:
        return agent_services.node_cordon(node=node, actor=actor, reason=reason)
    except agent_services.NodeStateError as exc:
        raise ConsoleError(str(exc)) from None


def node_drain(*, node: Node, actor, reason: str = "") -> Node:
    """No new jobs; the node becomes cordoned once its last job ends."""
    try:
        return agent_services.node_drain(node=node, actor=actor, reason=reason)
    except agent_services.NodeStateError as exc:
        raise ConsoleError(str(exc)) from None


def node_uncordon(*, node: Node, actor, reason: str = "") -> Node:
    """Back in the pool: the next pass may place jobs there."""
    try:
        return agent_services.node_uncordon(node=node, actor=actor)
    except agent_services.NodeStateError as exc:
        raise ConsoleError(str(exc)) from None


# --- jobs ------------------------------------------------------------------


def _job_snapshot(job: Job) -> dict:
    return {"state": job.state, "priority": job.priority.name, "stop_requested": job.stop_requested}


@transaction.atomic
def job_cancel(*, job: Job, actor, reason: str = "") -> Job:
    """Cancel a job for the operator (scheduler.services.job_cancel), audited."""
    with tenant_scope(job):
        job = Job.objects.select_related("priority", "tenant").get(pk=job.pk)
        if job.state in TERMINAL_STATES:
            raise ConsoleError(f"job {job.pk} is already {job.state}: only a job not yet finished can be cancelled")
        before = _job_snapshot(job)
        who = getattr(actor, "username", "") or "the operator"
        job = scheduler_services.job_cancel(job=job, actor=actor, reason=reason or f"cancelled by operator {who}")
        audit_record(
            actor=actor,
            tenant=job.tenant,
            action="job.cancel",
            target=f"job {job.pk}",
            before=before,
            after=_job_snapshot(job),
        )
    return job


@transaction.atomic
def job_priority_change(*, job: Job, priority: PriorityClass, actor) -> Job:
    """Move a queued job to another priority class; the next pass orders it by its new rank."""
    with tenant_scope(job):
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
            tenant_id=job.tenant_id,
            job=job,
            from_state=job.state,
            to_state=job.state,
            detail=f"class changed from {old} to {priority.name} by the operator",
        )
        audit_record(
            actor=actor,
            tenant=job.tenant,
            action="job.priority_change",
            target=f"job {job.pk}",
            before=before,
            after=_job_snapshot(job),
        )
    scheduler_services.schedule_soon()
    return job


# --- priority rules ----------------------------------------------------------------
# The scheduler owns the rules (scheduler.rules): each service there validates the whole rule
# set as it would be after one change, and audits it. A draft that changes several classes at
# once is applied in whatever order keeps every intermediate state valid.


def _class_changes(old: ClassDraft | None, new: ClassDraft) -> dict:
    """The fields of ``new`` that differ from ``old`` (all of them for a new class)."""
    before = old.snapshot() if old else {}
    return {name: value for name, value in new.snapshot().items() if before.get(name) != value}


class _DryRun(Exception):
    pass


@transaction.atomic
def rules_apply(*, current: RuleSet, proposed: RuleSet, actor) -> int:
    """Write the proposed rules (after the operator saw their preview): one audited change per item."""
    problems = rules_problems(proposed)
    if problems:
        raise ConsoleError("; ".join(problems))
    before = current.by_name()
    # Units of work: whole classes first (one audit row each); if they block each other (a default
    # moving between classes, a rank rising past a class that still preempts it), split them into
    # one unit per field, removals of may-preempt edges before additions.
    pending: list[tuple[str, dict]] = [
        (c.name, _class_changes(before.get(c.name), c)) for c in proposed.classes if before.get(c.name) != c
    ]
    split = False
    applied = 0
    while pending:
        refused: list[tuple[str, dict, str]] = []
        for name, changes in pending:
            try:
                with transaction.atomic():
                    rules_class_write(name=name, changes=changes, create=name not in before, actor=actor)
            except (RuleError, ConsoleError) as exc:
                refused.append((name, changes, str(exc)))
            else:
                applied += 1
        if len(refused) < len(pending):
            pending = [(name, changes) for name, changes, _ in refused]
        elif not split and any(name in before and len(changes) > 1 for name, changes, _ in refused):
            split = True
            pending = [unit for name, changes, _ in refused for unit in _field_units(name, changes, before)]
        else:
            raise ConsoleError("; ".join(f"class {name}: {reason}" for name, _, reason in refused))
    tenants = {t.slug: t for t in Tenant.objects.filter(slug__in=list(proposed.weights))}
    for slug, weight in proposed.weights.items():
        if Decimal(current.weights.get(slug, Decimal(1))) != Decimal(weight) and slug in tenants:
            _rule_call(tenant_weight_set, actor=actor, tenant=tenants[slug], weight=weight)
            applied += 1
    if current.half_life_s != proposed.half_life_s:
        _rule_call(scheduler_settings_update, actor=actor, fair_share_half_life_s=proposed.half_life_s)
        applied += 1
    return applied


def _rule_call(service, **kwargs):
    try:
        return service(**kwargs)
    except RuleError as exc:
        raise ConsoleError(str(exc)) from None


def _field_units(name: str, changes: dict, before: dict[str, ClassDraft]) -> list[tuple[str, dict]]:
    if name not in before:
        return [(name, changes)]
    units = []
    if "may_preempt" in changes:
        kept = sorted(set(changes["may_preempt"]) & before[name].may_preempt)
        units.append((name, {"may_preempt": kept}))
    units += [(name, {field: value}) for field, value in changes.items() if field != "may_preempt"]
    if "may_preempt" in changes:
        units.append((name, {"may_preempt": changes["may_preempt"]}))
    return units


def rules_class_write(*, name: str, changes: dict, create: bool, actor) -> PriorityClass:
    """Create or change one class through the scheduler's services."""
    if "price_multiplier" in changes:
        changes = {**changes, "price_multiplier": Decimal(str(changes["price_multiplier"]))}
    if create:
        fields = dict(changes)
        rank = fields.pop("rank")
        return priority_class_create(actor=actor, name=name, rank=rank, **fields)
    found = PriorityClass.objects.get(name=name)
    return priority_class_update(actor=actor, priority_class=found, changes=changes)


def rules_dry_run(*, current: RuleSet, proposed: RuleSet) -> list[str]:
    """What the scheduler's own validation says of ``proposed``: applied in a savepoint, then rolled back."""
    try:
        with transaction.atomic():
            rules_apply(current=current, proposed=proposed, actor=None)
            raise _DryRun
    except _DryRun:
        return []
    except ConsoleError as exc:
        return [str(exc)]


def priority_class_save(*, priority_class: PriorityClass | None, draft: ClassDraft, actor) -> PriorityClass:
    """Create (``priority_class=None``) or update a class from the admin's form."""
    from . import replay

    old = replay.ruleset_current().by_name().get(priority_class.name) if priority_class else None
    try:
        return rules_class_write(name=draft.name, changes=_class_changes(old, draft), create=old is None, actor=actor)
    except RuleError as exc:
        raise ConsoleError(str(exc)) from None


# --- tenants, plans, prices --------------------------------------------------------


def _plain(value):
    return value if value is None or isinstance(value, bool | int | str) else str(value)


@acts_for_tenant
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
    audit_record(
        actor=actor, tenant=locked, action="tenant.update", target=locked.slug, before=before, after=dict(changes)
    )
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
        actor=actor,
        tenant=None,
        action="plan.create" if created else "plan.update",
        target=plan.name,
        before=before,
        after={name: _plain(getattr(plan, name)) for name in (changed or ["name"])},
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
        .order_by("-effective_from")
        .first()
    )
    if Price.objects.filter(gpu_model=gpu_model, mode=mode, effective_from=effective_from).exists():
        raise ConsoleError(f"{gpu_model} {mode} already has a price from {effective_from:%Y-%m-%d %H:%M}")
    price = Price.objects.create(
        gpu_model=gpu_model, mode=mode, per_gpu_hour=per_gpu_hour, currency=currency, effective_from=effective_from
    )
    audit_record(
        actor=actor,
        tenant=None,
        action="price.add",
        target=f"{gpu_model} {mode}",
        before={"per_gpu_hour": str(previous.per_gpu_hour), "effective_from": previous.effective_from.isoformat()}
        if previous
        else None,
        after={"per_gpu_hour": str(per_gpu_hour), "currency": currency, "effective_from": effective_from.isoformat()},
    )
    return price


# --- what-if runs (large previews, computed by a Celery task) -------------------------------


@transaction.atomic
def whatif_run_start(*, actor, proposed: RuleSet, start: datetime, end: datetime) -> WhatIfRun:
    """Queue a preview of ``proposed`` over [start, end); the task runs after commit."""
    from .tasks import whatif_run_task

    run = WhatIfRun.objects.create(
        created_by=actor if getattr(actor, "pk", None) else None,
        window_start=start,
        window_end=end,
        draft=ruleset_to_data(proposed),
    )
    transaction.on_commit(lambda: whatif_run_task.delay(run_id=run.pk))
    return run


def whatif_run_execute(*, run_id: int) -> WhatIfRun | None:
    """Compute a queued preview (safe to run twice: a finished run is left alone)."""
    from . import replay

    with transaction.atomic():
        run = WhatIfRun.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.state in (WhatIfRun.State.DONE, WhatIfRun.State.FAILED):
            return run
        run.state = WhatIfRun.State.RUNNING
        run.save(update_fields=["state"])
    try:
        comparison = replay.preview_window(
            proposed=ruleset_from_data(run.draft), start=run.window_start, end=run.window_end
        )
    except replay.ReplayTooLarge as exc:
        run.state, run.error = WhatIfRun.State.FAILED, str(exc)[:300]
    else:
        run.state, run.result = WhatIfRun.State.DONE, whatif.comparison_to_data(comparison)
    run.finished_at = timezone.now()
    run.save(update_fields=["state", "result", "error", "finished_at"])
    return run
