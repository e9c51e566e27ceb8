"""Feeds the what-if replay from the database: recorded submissions, the fleet as it is now,
and the rules in force (or proposed). The simulation itself is console.whatif (pure)."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.utils import timezone
from django_scopes import scopes_disabled

from agents.models import Gpu
from billing.selectors import model_prices
from scheduler import placement
from scheduler.models import MILLI_PER_GPU, JobMode, PriorityClass, TenantShare
from scheduler.passes import mig_slots, settings_get

from . import selectors, whatif
from .rules import ClassDraft, RuleSet


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def history_between(*, start: datetime, end: datetime) -> list[whatif.HistoryJob]:
    """Submissions in [start, end): each runs for what it ran (started -> finished), or its max runtime."""
    history = []
    for job in selectors.submissions_between(start=start, end=end):
        max_runtime_ms = job.max_runtime_s * 1000
        if job.started_at and job.finished_at:
            run_ms = max(1, _ms(job.finished_at) - _ms(job.started_at))
        else:
            run_ms = max_runtime_ms
        shared = job.mode == JobMode.SHARED
        history.append(
            whatif.HistoryJob(
                job_id=job.pk,
                tenant=job.tenant.slug,
                priority=job.priority.name,
                submitted_ms=_ms(job.submitted_at),
                run_ms=run_ms,
                shared=shared,
                count=1 if shared else job.gpu_milli // MILLI_PER_GPU,
                share_milli=job.gpu_milli if shared else MILLI_PER_GPU,
                gpu_model=job.gpu_model,
                gpu_memory_mb=job.gpu_memory_mb or 0,
                max_runtime_ms=max_runtime_ms,
            )
        )
    return history


@scopes_disabled()  # the operator's what-if: every tenant's reservations
def fleet_now() -> list[placement.NodeSlot]:
    """The fleet as it is now (schedulable nodes, healthy GPUs, reservations), with nothing held."""
    nodes: dict[str, placement.NodeSlot] = {}
    for gpu in Gpu.objects.select_related("node").order_by("node__name", "index"):
        node = nodes.setdefault(gpu.node.name, placement.NodeSlot(name=gpu.node.name, schedulable=gpu.node.schedulable))
        node.gpus.append(
            placement.GpuSlot(
                uuid=gpu.uuid,
                node=gpu.node.name,
                model=gpu.model,
                memory_mb=gpu.memory_mb,
                reservation=gpu.reservation,
                healthy=gpu.health == Gpu.Health.OK,
                mig=mig_slots(gpu.mig_mode, gpu.mig_instances),
            )
        )
    return list(nodes.values())


def ruleset_current() -> RuleSet:
    classes = tuple(
        ClassDraft(
            name=c.name,
            rank=c.rank,
            preemptible=c.preemptible,
            may_preempt=frozenset(p.name for p in c.may_preempt.all()),
            min_runtime_s=c.min_runtime_s,
            grace_period_s=c.grace_period_s,
            price_multiplier=c.price_multiplier,
            default_for_kind=c.default_for_kind,
        )
        for c in PriorityClass.objects.prefetch_related("may_preempt").order_by("-rank", "name")
    )
    return RuleSet(classes=classes, weights=weights_current(), half_life_s=half_life_current_s())


@scopes_disabled()  # the operator's what-if: every tenant's weight
def weights_current() -> dict[str, Decimal]:
    """Tenant slug -> fair-share weight, for tenants that have one set (the rest weigh 1)."""
    return dict(TenantShare.objects.values_list("tenant__slug", "weight"))


def half_life_current_s() -> int:
    return settings_get().fair_share_half_life_s


def whatif_rules(rules: RuleSet) -> whatif.Rules:
    """The rule set as the replay takes it; backfill and default runtime are the scheduler's settings."""
    conf = settings_get()
    return whatif.Rules(
        classes={
            c.name: whatif.ClassRule(
                name=c.name,
                rank=c.rank,
                preemptible=c.preemptible,
                may_preempt=frozenset(c.may_preempt),
                min_runtime_ms=c.min_runtime_s * 1000,
                grace_ms=c.grace_period_s * 1000,
            )
            for c in rules.classes
        },
        tenant_weights={slug: float(w) for slug, w in rules.weights.items()},
        half_life_ms=max(1, rules.half_life_s) * 1000,
        backfill=conf.backfill,
        default_max_runtime_ms=conf.default_max_runtime_s * 1000,
        # as scheduler.passes does: a stopping job's GPUs are expected back after the longest grace
        preempt_grace_ms=max((c.grace_period_s for c in rules.classes), default=30) * 1000,
        limits=limits_now(),
        model_price=model_prices(at=timezone.now()),
    )


@scopes_disabled()  # the operator's what-if: every tenant's caps
def limits_now() -> dict[str, placement.Limits]:
    """Tenants' concurrent caps as they are now (accounts.selectors.limits_for: quota over plan), by slug.
    A suspension or an exhausted budget is not replayed: it depends on that time, not on the rules."""
    from accounts.models import Tenant
    from accounts.selectors import limits_for

    out = {}
    for tenant in Tenant.objects.all():
        limits = limits_for(tenant)
        if limits.max_dedicated_gpus is not None or limits.max_shared_milli is not None:
            out[tenant.slug] = placement.Limits(
                dedicated_gpus=limits.max_dedicated_gpus, shared_milli=limits.max_shared_milli
            )
    return out


INLINE_REPLAY_JOBS = 500  # replayed while the page waits; more goes to a Celery task the page polls
MAX_REPLAY_JOBS = 20_000  # ~15 s per rule set for 2,000 on 160 GPUs, on a loaded 2-core machine (whatif_bench)


class ReplayTooLarge(ValueError):
    pass


def preview(*, proposed: RuleSet, hours: int = 24, end: datetime | None = None) -> whatif.Comparison:
    """Replay the last ``hours`` (to ``end``, default now) under the rules in force and under ``proposed``."""
    end = end or timezone.now()
    return preview_window(proposed=proposed, start=end - timedelta(hours=hours), end=end)


def preview_window(*, proposed: RuleSet, start: datetime, end: datetime) -> whatif.Comparison:
    history = history_between(start=start, end=end)
    if len(history) > MAX_REPLAY_JOBS:
        raise ReplayTooLarge(
            f"the window holds {len(history)} submissions and a preview replays at most {MAX_REPLAY_JOBS}: "
            "choose a shorter window"
        )
    return whatif.compare(
        history=history,
        nodes=fleet_now(),
        current=whatif_rules(ruleset_current()),
        proposed=whatif_rules(proposed),
        window_start_ms=_ms(start),
        window_end_ms=_ms(end),
    )
