"""Read queries for the operator console. Platform-wide, so every one runs with scopes disabled."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal

from django.db.models import Count, Q, Sum
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents.models import Gpu, GpuOutage, Node
from scheduler.models import ACTIVE_STATES, MILLI_PER_GPU, Allocation, Job, JobMode, JobState

# --- fleet -----------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    job_id: int
    job_name: str
    tenant: str
    priority: str
    share_milli: int
    isolation: str
    state: str

    @property
    def fraction(self) -> str:
        if self.share_milli == MILLI_PER_GPU:
            return "whole"
        return f"{self.share_milli / MILLI_PER_GPU:g}"


@dataclass
class GpuCell:
    gpu: Gpu
    holders: list[Holder] = field(default_factory=list)
    outage: GpuOutage | None = None

    @property
    def used_milli(self) -> int:
        return sum(h.share_milli for h in self.holders)

    @property
    def state(self) -> str:
        """ok-free, ok-shared, ok-dedicated, or out (of service)."""
        if self.gpu.health != Gpu.Health.OK:
            return "out"
        if not self.holders:
            return "free"
        return "dedicated" if any(h.share_milli == MILLI_PER_GPU for h in self.holders) else "shared"

    def metric(self, name: str):
        return (self.gpu.last_metrics or {}).get(name)

    @property
    def util(self):
        return self.metric("util")

    @property
    def memory_used_mb(self):
        return self.metric("memory_used_mb")

    @property
    def temperature_c(self):
        return self.metric("temperature_c")


@dataclass
class NodeRow:
    node: Node
    gpus: list[GpuCell]
    running_jobs: int
    refused: int = 0  # node-link messages refused (commands, reports, GPU claims): agents.LinkRefusal
    quarantined: int = 0  # usage windows ingest refused: agents.QuarantinedWindow

    @property
    def used_milli(self) -> int:
        return sum(c.used_milli for c in self.gpus)


@scopes_disabled()  # the operator's console: every tenant's holds
def fleet_grid() -> list[NodeRow]:
    """Every node and GPU with who holds what, in three queries."""
    gpus = list(Gpu.objects.select_related("node").order_by("node__name", "index"))
    holders: dict[int, list[Holder]] = defaultdict(list)
    live = Allocation.objects.filter(released_at__isnull=True).select_related("job__tenant", "job__priority")
    for allocation in live:
        job = allocation.job
        holders[allocation.gpu_id].append(
            Holder(
                job_id=job.pk,
                job_name=job.name,
                tenant=job.tenant.slug,
                priority=job.priority.name,
                share_milli=allocation.share_milli,
                isolation=job.isolation or ("exclusive" if job.mode == JobMode.DEDICATED else ""),
                state=job.state,
            )
        )
    outages = {o.gpu_id: o for o in GpuOutage.objects.filter(ended_at__isnull=True)}
    rows: dict[int, NodeRow] = {}
    from agents.models import LinkRefusal, QuarantinedWindow

    refused = dict(
        LinkRefusal.objects.filter(node__isnull=False).values("node").annotate(n=Count("id")).values_list("node", "n")
    )
    quarantined = dict(QuarantinedWindow.objects.values("node").annotate(n=Count("id")).values_list("node", "n"))
    for node in Node.objects.annotate(running=Count("jobs", filter=Q(jobs__state__in=ACTIVE_STATES))):
        rows[node.pk] = NodeRow(
            node=node,
            gpus=[],
            running_jobs=node.running,
            refused=refused.get(node.pk, 0),
            quarantined=quarantined.get(node.pk, 0),
        )
    for gpu in gpus:
        rows[gpu.node_id].gpus.append(GpuCell(gpu=gpu, holders=holders.get(gpu.pk, []), outage=outages.get(gpu.pk)))
    return list(rows.values())


@dataclass(frozen=True)
class FleetSummary:
    nodes: int
    nodes_schedulable: int
    gpus: int
    gpus_out_of_service: int
    allocated_milli: int

    @property
    def allocated_percent(self) -> float:
        usable = (self.gpus - self.gpus_out_of_service) * MILLI_PER_GPU
        return 100.0 * self.allocated_milli / usable if usable else 0.0


def fleet_summary(rows: list[NodeRow]) -> FleetSummary:
    cells = [c for r in rows for c in r.gpus]
    return FleetSummary(
        nodes=len(rows),
        nodes_schedulable=sum(1 for r in rows if r.node.schedulable),
        gpus=len(cells),
        gpus_out_of_service=sum(1 for c in cells if c.state == "out"),
        allocated_milli=sum(c.used_milli for c in cells),
    )


# --- queue -----------------------------------------------------------------


@dataclass(frozen=True)
class QueueRow:
    position: int
    job: Job

    @property
    def waited_s(self) -> float:
        from django.utils import timezone

        return (timezone.now() - self.job.submitted_at).total_seconds()


@scopes_disabled()  # the operator's console: every tenant's queue
def queue_rows(*, limit: int = 500) -> list[QueueRow]:
    """The queued jobs in the order the scheduler considers them (class rank, then submit time).

    Fair share reorders tenants within a class at each pass; ``pending_reason``
    and ``estimated_start_at`` are what the last pass wrote.
    """
    queued = (
        Job.objects.filter(state=JobState.QUEUED)
        .select_related("tenant", "priority")
        .order_by("-priority__rank", "submitted_at", "id")[:limit]
    )
    return [QueueRow(position=i, job=job) for i, job in enumerate(queued, start=1)]


@scopes_disabled()  # the operator's console: any tenant's job
def job_for_console(*, job_id: int) -> Job | None:
    return Job.objects.select_related("tenant", "priority", "node").filter(pk=job_id).first()


# --- audit -----------------------------------------------------------------


RULE_ACTIONS = ("priority_class.", "scheduler.")


def rule_changes_recent(*, limit: int = 20) -> list[AuditLog]:
    """The latest audited changes to priority classes, weights and scheduler settings."""
    query = Q()
    for prefix in RULE_ACTIONS:
        query |= Q(action__startswith=prefix)
    return list(AuditLog.objects.filter(query).select_related("actor", "tenant")[:limit])


# --- history for the what-if replay ----------------------------------------


@scopes_disabled()  # the operator's what-if: every tenant's submissions
def submissions_between(*, start: datetime, end: datetime) -> list[Job]:
    """Jobs submitted in [start, end), with what the replay needs."""
    return list(
        Job.objects.filter(submitted_at__gte=start, submitted_at__lt=end)
        .select_related("tenant", "priority")
        .only(
            "id",
            "tenant__slug",
            "priority__name",
            "submitted_at",
            "started_at",
            "finished_at",
            "gpu_milli",
            "mode",
            "gpu_model",
            "gpu_memory_mb",
            "max_runtime_s",
            "state",
        )
        .order_by("submitted_at", "id")
    )


@scopes_disabled()  # the operator's what-if: every tenant's submissions
def submissions_count(*, start: datetime, end: datetime) -> int:
    return Job.objects.filter(submitted_at__gte=start, submitted_at__lt=end).count()


def tenant_slugs() -> list[str]:
    from accounts.models import Tenant

    return list(Tenant.objects.order_by("slug").values_list("slug", flat=True))


# --- reports ---------------------------------------------------------------

GPU_HOUR = 1000 * 3_600_000  # the ledger counts milli-GPU-milliseconds


@dataclass
class UsageLine:
    name: str
    gpus: int = 0
    available_gpu_hours: float = 0.0  # in service
    held_gpu_hours: float = 0.0
    out_of_service_gpu_hours: float = 0.0
    revenue: Decimal = Decimal(0)

    @property
    def utilisation_percent(self) -> float:
        return 100.0 * self.held_gpu_hours / self.available_gpu_hours if self.available_gpu_hours else 0.0

    @property
    def idle_gpu_hours(self) -> float:
        return max(0.0, self.available_gpu_hours - self.held_gpu_hours)


def _line(totals) -> UsageLine:
    return UsageLine(
        name=totals.key,
        gpus=totals.gpus,
        available_gpu_hours=(totals.capacity - totals.out_of_service) / GPU_HOUR,
        held_gpu_hours=totals.held / GPU_HOUR,
        out_of_service_gpu_hours=totals.out_of_service / GPU_HOUR,
        revenue=totals.revenue,
    )


@dataclass
class Report:
    month: date
    until: datetime
    by_model: list[UsageLine]
    by_node: list[UsageLine]
    total: UsageLine
    top_tenants: list[UsageLine]
    problems: list[str]


@scopes_disabled()  # the operator's report: every tenant's usage
def usage_report(*, month: date, now: datetime) -> Report:
    """Utilisation, idle and out-of-service capacity and revenue per GPU model and node for a month
    (up to now if current), from the billing ledger (every GPU-second: held + idle + out of service);
    and the top tenants by revenue."""
    from billing.models import Charge
    from billing.selectors import ledger_month

    ledger = ledger_month(month=month, until=now)
    tenants: dict[str, UsageLine] = {}
    charges = Charge.objects.filter(month=month)
    for slug, amount, gpu_ms in charges.values_list("tenant__slug").annotate(a=Sum("amount"), ms=Sum("gpu_ms")):
        tenants[slug] = UsageLine(slug, held_gpu_hours=gpu_ms / 3_600_000, revenue=amount)
    top = sorted(tenants.values(), key=lambda t: (-t.revenue, -t.held_gpu_hours, t.name))[:10]
    total = _line(ledger.total) if ledger.total else UsageLine("all")
    return Report(
        month=month,
        until=min(now, datetime.fromtimestamp(ledger.end_ms / 1000, tz=UTC)),
        by_model=[_line(t) for t in ledger.by_model],
        by_node=[_line(t) for t in ledger.by_node],
        total=total,
        top_tenants=top,
        problems=ledger.problems,
    )
