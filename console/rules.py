"""Priority rules as plain data, and the checks that keep them free of contradictions.

No Django: the console's forms and the what-if replay both work on these drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

JOB_KINDS = ("training", "inference")


@dataclass(frozen=True)
class ClassDraft:
    name: str
    rank: int
    preemptible: bool = False
    may_preempt: frozenset[str] = frozenset()
    min_runtime_s: int = 0
    grace_period_s: int = 30
    price_multiplier: Decimal = Decimal(1)
    default_for_kind: str = ""

    @classmethod
    def from_form(cls, data: dict, *, name: str) -> ClassDraft:
        """A draft from a priority-class form's cleaned data (``may_preempt``: PriorityClass objects)."""
        return cls(
            name=name,
            rank=data["rank"],
            preemptible=data["preemptible"],
            may_preempt=frozenset(c.name for c in data["may_preempt"]),
            min_runtime_s=data["min_runtime_s"],
            grace_period_s=data["grace_period_s"],
            price_multiplier=data["price_multiplier"],
            default_for_kind=data["default_for_kind"],
        )

    def snapshot(self) -> dict:
        return {
            "rank": self.rank,
            "preemptible": self.preemptible,
            "may_preempt": sorted(self.may_preempt),
            "min_runtime_s": self.min_runtime_s,
            "grace_period_s": self.grace_period_s,
            "price_multiplier": str(self.price_multiplier),
            "default_for_kind": self.default_for_kind,
        }


@dataclass(frozen=True)
class RuleSet:
    classes: tuple[ClassDraft, ...]
    weights: dict[str, Decimal] = field(default_factory=dict)  # tenant slug -> fair-share weight
    half_life_s: int = 7 * 24 * 3600

    def by_name(self) -> dict[str, ClassDraft]:
        return {c.name: c for c in self.classes}


def _cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """A preemption cycle (a -> b -> ... -> a) if there is one, else None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def rules_problems(rules: RuleSet) -> list[str]:
    """Every contradiction in ``rules``, each a sentence naming the rule it breaks."""
    problems: list[str] = []
    classes = rules.by_name()
    for c in rules.classes:
        if c.name in c.may_preempt:
            problems.append(f"class {c.name} may not preempt itself")
        for target in sorted(c.may_preempt - {c.name}):
            other = classes.get(target)
            if other is None:
                problems.append(f"class {c.name} may preempt {target}, which does not exist")
            elif not other.preemptible:
                problems.append(f"class {c.name} may preempt {target}, but {target} is not preemptible")
            elif other.rank >= c.rank:
                problems.append(
                    f"class {c.name} (rank {c.rank}) may preempt only lower ranks, but {target} has rank {other.rank}"
                )
        if c.default_for_kind and c.default_for_kind not in JOB_KINDS:
            problems.append(
                f"class {c.name} is the default for '{c.default_for_kind}', which is not a job kind "
                f"(kinds: {', '.join(JOB_KINDS)})"
            )
        if c.min_runtime_s < 0 or c.grace_period_s < 0:
            problems.append(f"class {c.name}: minimum runtime and grace period are seconds, 0 or more")
        if c.price_multiplier <= 0:
            problems.append(f"class {c.name}: the price multiplier must be above 0")
    for kind in JOB_KINDS:
        defaults = sorted(c.name for c in rules.classes if c.default_for_kind == kind)
        if len(defaults) > 1:
            problems.append(f"one default class per job kind: {kind} has {', '.join(defaults)}")
    graph = {c.name: c.may_preempt & set(classes) - {c.name} for c in rules.classes}
    if cycle := _cycle(graph):
        problems.append(f"preemption cycle: {' -> '.join(cycle)} (classes would preempt each other in turn)")
    for slug, weight in sorted(rules.weights.items()):
        if weight <= 0:
            problems.append(f"tenant {slug}: a fair-share weight must be above 0")
    if rules.half_life_s <= 0:
        problems.append("the fair-share half-life must be at least one second")
    return problems


@dataclass(frozen=True)
class Change:
    what: str  # "class standard", "tenant acme", "fair share"
    field: str
    before: object
    after: object


def rule_changes(current: RuleSet, proposed: RuleSet) -> list[Change]:
    """What differs between two rule sets, field by field."""
    changes: list[Change] = []
    before = current.by_name()
    for c in proposed.classes:
        old = before.get(c.name)
        old_snapshot = old.snapshot() if old else {}
        for name, value in c.snapshot().items():
            if old_snapshot.get(name) != value:
                changes.append(Change(f"class {c.name}", name, old_snapshot.get(name), value))
    for slug in sorted(set(current.weights) | set(proposed.weights)):
        old_w, new_w = current.weights.get(slug, Decimal(1)), proposed.weights.get(slug, Decimal(1))
        if Decimal(old_w) != Decimal(new_w):
            changes.append(Change(f"tenant {slug}", "weight", str(old_w), str(new_w)))
    if current.half_life_s != proposed.half_life_s:
        changes.append(Change("fair share", "half_life_s", current.half_life_s, proposed.half_life_s))
    return changes


def ruleset_to_data(rules: RuleSet) -> dict:
    """Plain JSON-able data (for a queued what-if run)."""
    return {
        "classes": [{"name": c.name, **c.snapshot()} for c in rules.classes],
        "weights": {slug: str(w) for slug, w in rules.weights.items()},
        "half_life_s": rules.half_life_s,
    }


def ruleset_from_data(data: dict) -> RuleSet:
    return RuleSet(
        classes=tuple(
            ClassDraft(
                name=c["name"],
                rank=c["rank"],
                preemptible=c["preemptible"],
                may_preempt=frozenset(c["may_preempt"]),
                min_runtime_s=c["min_runtime_s"],
                grace_period_s=c["grace_period_s"],
                price_multiplier=Decimal(c["price_multiplier"]),
                default_for_kind=c["default_for_kind"],
            )
            for c in data["classes"]
        ),
        weights={slug: Decimal(w) for slug, w in data["weights"].items()},
        half_life_s=data["half_life_s"],
    )
