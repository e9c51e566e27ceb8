"""The operator's scheduling rules are data: priority classes, tenant weights and
the scheduler's settings. Every change goes through a service here: validated,
audited in the same transaction, and followed by the next scheduling pass.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django.db import transaction

from accounts.models import Tenant
from accounts.services import audit_record
from accounts.tenancy import tenant_scope

from .models import JobKind, PriorityClass, SchedulerSettings, TenantShare
from .passes import settings_get
from .services import schedule_soon

KINDS = {"", JobKind.TRAINING, JobKind.INFERENCE}
MAX_GRACE_S = 24 * 3600
MAX_WEIGHT = Decimal("10000")


class RuleError(Exception):
    """A rule change the scheduler refuses; ``field`` names the input at fault."""

    def __init__(self, message: str, *, field: str | None = None, code: str = "invalid"):
        super().__init__(message)
        self.field = field
        self.code = code


def _class_snapshot(klass: PriorityClass) -> dict:
    return {
        "name": klass.name,
        "rank": klass.rank,
        "preemptible": klass.preemptible,
        "may_preempt": sorted(c.name for c in klass.may_preempt.all()) if klass.pk else [],
        "min_runtime_s": klass.min_runtime_s,
        "grace_period_s": klass.grace_period_s,
        "price_multiplier": str(klass.price_multiplier),
        "default_for_kind": klass.default_for_kind,
    }


def _int(value, field: str, *, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuleError(f"{field} must be a whole number", field=field)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RuleError(f"{field} must be {bound}", field=field)
    return value


def _apply(klass: PriorityClass, changes: dict) -> list[str] | None:
    """Copy validated fields onto ``klass``; returns the new may_preempt names, if given."""
    unknown = set(changes) - {
        "rank",
        "preemptible",
        "may_preempt",
        "min_runtime_s",
        "grace_period_s",
        "price_multiplier",
        "default_for_kind",
    }
    if unknown:
        raise RuleError(f"unknown priority class field(s): {', '.join(sorted(unknown))}", field=sorted(unknown)[0])
    if "rank" in changes:
        klass.rank = _int(changes["rank"], "rank", low=-1_000_000, high=1_000_000)
    if "preemptible" in changes:
        if not isinstance(changes["preemptible"], bool):
            raise RuleError("preemptible must be true or false", field="preemptible")
        klass.preemptible = changes["preemptible"]
    if "min_runtime_s" in changes:
        klass.min_runtime_s = _int(changes["min_runtime_s"], "min_runtime_s")
    if "grace_period_s" in changes:
        klass.grace_period_s = _int(changes["grace_period_s"], "grace_period_s", high=MAX_GRACE_S)
    if "price_multiplier" in changes:
        try:
            multiplier = Decimal(str(changes["price_multiplier"]))
        except InvalidOperation:
            raise RuleError("price_multiplier must be a decimal number", field="price_multiplier") from None
        if not multiplier.is_finite() or multiplier <= 0 or multiplier > 100:
            raise RuleError("price_multiplier must be above 0 and at most 100", field="price_multiplier")
        klass.price_multiplier = multiplier
    if "default_for_kind" in changes:
        if changes["default_for_kind"] not in KINDS:
            raise RuleError("default_for_kind must be training, inference or empty", field="default_for_kind")
        klass.default_for_kind = changes["default_for_kind"]
    if "may_preempt" in changes:
        names = changes["may_preempt"]
        if not isinstance(names, list | tuple | set) or not all(isinstance(n, str) for n in names):
            raise RuleError("may_preempt must be a list of class names", field="may_preempt")
        return sorted(set(names))
    return None


def _validate(klass: PriorityClass, may_preempt: list[str], before_defaults: set[str]) -> list[PriorityClass]:
    """Check the whole rule set as it would be after the change; returns the preempted classes."""
    others = {c.name: c for c in PriorityClass.objects.exclude(pk=klass.pk).prefetch_related("may_preempt")}
    if klass.name in may_preempt:
        raise RuleError(f"class {klass.name} cannot preempt itself", field="may_preempt")
    missing = [n for n in may_preempt if n not in others]
    if missing:
        known = ", ".join(sorted(others)) or "none"
        raise RuleError(f"unknown class(es) {', '.join(missing)} (known: {known})", field="may_preempt")
    targets = [others[n] for n in may_preempt]
    for target in targets:
        if not target.preemptible:
            raise RuleError(f"class {target.name} is not preemptible", field="may_preempt")
        if target.rank >= klass.rank:
            raise RuleError(
                f"class {klass.name} (rank {klass.rank}) may only preempt lower-ranked classes; "
                f"{target.name} has rank {target.rank}",
                field="may_preempt",
            )
    for other in others.values():
        if klass.name in {c.name for c in other.may_preempt.all()}:
            if not klass.preemptible:
                raise RuleError(
                    f"class {other.name} may preempt {klass.name}, so it must stay preemptible", field="preemptible"
                )
            if other.rank <= klass.rank:
                raise RuleError(
                    f"class {other.name} (rank {other.rank}) preempts {klass.name}, so {klass.name}'s rank must "
                    f"stay below {other.rank}",
                    field="rank",
                )
    graph = {name: {c.name for c in c_.may_preempt.all()} for name, c_ in others.items()}
    graph[klass.name] = set(may_preempt)
    _acyclic(graph)
    after_defaults = {c.default_for_kind for c in others.values() if c.default_for_kind} | (
        {klass.default_for_kind} if klass.default_for_kind else set()
    )
    lost = before_defaults - after_defaults
    if lost:
        raise RuleError(
            f"{', '.join(sorted(lost))} jobs would have no default priority class; make another class the default "
            "first",
            field="default_for_kind",
        )
    return targets


def _acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise RuleError(f"preemption rules would form a cycle: {cycle}", field="may_preempt")
        state[name] = 1
        for nxt in graph.get(name, ()):
            visit(nxt, [*path, name])
        state[name] = 2

    for name in graph:
        visit(name, [])


def _defaults() -> set[str]:
    return set(PriorityClass.objects.exclude(default_for_kind="").values_list("default_for_kind", flat=True))


@transaction.atomic
def priority_class_create(*, actor, name: str, rank: int, **fields) -> PriorityClass:
    """A new class; ``fields`` as for :func:`priority_class_update`."""
    from django.utils.text import slugify

    if not name or slugify(name) != name or len(name) > 50:
        raise RuleError("name must be a short slug (letters, digits, hyphens)", field="name")
    if PriorityClass.objects.filter(name=name).exists():
        raise RuleError(f"a class named {name} exists already", field="name", code="conflict")
    before = _defaults()
    klass = PriorityClass(name=name)
    may_preempt = _apply(klass, {"rank": rank, **fields}) or []
    targets = _validate(klass, may_preempt, before)
    klass.save()
    klass.may_preempt.set(targets)
    audit_record(actor=actor, tenant=None, action="priority_class.create", target=name, after=_class_snapshot(klass))
    schedule_soon()
    return klass


@transaction.atomic
def priority_class_update(*, actor, priority_class: PriorityClass, changes: dict) -> PriorityClass:
    """Change a class (rank, preemptible, may_preempt (names), min_runtime_s, grace_period_s,
    price_multiplier, default_for_kind). The next pass follows the new rules."""
    klass = PriorityClass.objects.select_for_update().get(pk=priority_class.pk)
    before = _class_snapshot(klass)
    defaults = _defaults()
    may_preempt = _apply(klass, changes)
    if may_preempt is None:
        may_preempt = before["may_preempt"]
    targets = _validate(klass, may_preempt, defaults)
    klass.save()
    klass.may_preempt.set(targets)
    after = _class_snapshot(klass)
    if after != before:
        audit_record(
            actor=actor, tenant=None, action="priority_class.update", target=klass.name, before=before, after=after
        )
        schedule_soon()
    return klass


@transaction.atomic
def tenant_weight_set(*, actor, tenant: Tenant, weight) -> TenantShare:
    """A tenant's fair-share weight (default 1), from 0.001 to 10000."""
    try:
        value = Decimal(str(weight))
    except InvalidOperation:
        raise RuleError("weight must be a decimal number", field="weight") from None
    if not value.is_finite() or value < Decimal("0.001") or value > MAX_WEIGHT:
        raise RuleError(f"weight must be from 0.001 to {MAX_WEIGHT}", field="weight")
    value = value.quantize(Decimal("0.001"))
    with tenant_scope(tenant):
        share, _ = TenantShare.objects.select_for_update().get_or_create(tenant=tenant)
        before = str(share.weight)
        share.weight = value
        share.save(update_fields=["weight"])
    audit_record(
        actor=actor,
        tenant=tenant,
        action="scheduler.tenant_weight",
        target=tenant.slug,
        before={"weight": before},
        after={"weight": str(value)},
    )
    schedule_soon()
    return share


# The scheduler's settings an operator sets (SchedulerSettings' fields; the console's form shows these).
SCHEDULER_KNOBS = (
    "fair_share_half_life_s",
    "default_max_runtime_s",
    "backfill",
    "defrag",
    "defrag_min_interval_s",
    "defrag_min_gain_s",
)


@transaction.atomic
def scheduler_settings_update(
    *,
    actor,
    fair_share_half_life_s: int | None = None,
    default_max_runtime_s: int | None = None,
    backfill: bool | None = None,
    defrag: bool | None = None,
    defrag_min_interval_s: int | None = None,
    defrag_min_gain_s: int | None = None,
) -> SchedulerSettings:
    conf = settings_get()
    before = {name: getattr(conf, name) for name in SCHEDULER_KNOBS}
    if fair_share_half_life_s is not None:
        conf.fair_share_half_life_s = _int(fair_share_half_life_s, "fair_share_half_life_s", low=1)
    if default_max_runtime_s is not None:
        conf.default_max_runtime_s = _int(default_max_runtime_s, "default_max_runtime_s", low=1)
    if backfill is not None:
        if not isinstance(backfill, bool):
            raise RuleError("backfill must be true or false", field="backfill")
        conf.backfill = backfill
    if defrag is not None:
        if not isinstance(defrag, bool):
            raise RuleError("defrag must be true or false", field="defrag")
        conf.defrag = defrag
    if defrag_min_interval_s is not None:
        conf.defrag_min_interval_s = _int(defrag_min_interval_s, "defrag_min_interval_s", low=0)
    if defrag_min_gain_s is not None:
        conf.defrag_min_gain_s = _int(defrag_min_gain_s, "defrag_min_gain_s", low=0)
    conf.save()
    after = {name: getattr(conf, name) for name in SCHEDULER_KNOBS}
    audit_record(actor=actor, tenant=None, action="scheduler.settings", target="scheduler", before=before, after=after)
    schedule_soon()
    return conf
