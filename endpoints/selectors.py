"""Read queries for endpoints, including the gateway's routing table."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.db.models import Count, DecimalField, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce
from django_scopes import scopes_disabled

from scheduler.models import JobState

from .models import Endpoint, Replica

ROUTABLE_JOB_STATES = (JobState.RUNNING,)
FIRST_PASS_PENDING = "waiting for the next scheduling pass"  # a queued job no pass has looked at yet


@dataclass(frozen=True)
class Route:
    replica_id: int
    address: str
    port: int
    state: str  # starting | ready | draining
    version: int


@dataclass(frozen=True)
class EndpointRoute:
    endpoint_id: int
    tenant_id: int
    tenant_slug: str
    name: str
    health_path: str
    version: int
    idle_timeout_s: int
    replicas: tuple[Route, ...]
    max_replicas: int = 1
    # Replicas whose job a scheduling pass could not place (no capacity): while there are such and none
    # is starting on a node, a request cannot be served soon and is answered 503 at once.
    unplaceable: int = 0


def node_address(node_name: str, reported: str = "") -> str:
    """Where a node's replicas listen, written as the host part of a URL (an IPv6 address in brackets).

    The operator's GPUSHARE["NODE_ADDRESSES"] (env GPUSHARE_NODE_ADDRESSES) wins over the address the
    node's agent ``reported``: an agent only sees its own interfaces, and behind NAT, or on a host with
    several networks, the address the gateway must use is not one the agent would pick. Then 127.0.0.1,
    right when everything runs on one host (``make run``).
    """
    address = settings.GPUSHARE.get("NODE_ADDRESSES", {}).get(node_name) or reported or "127.0.0.1"
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


@scopes_disabled()  # the gateway routes every tenant's endpoints
def routing_table() -> dict[tuple[str, str], EndpointRoute]:
    """(tenant slug, endpoint name) -> the endpoint and its running replicas."""
    routes: dict[int, list[Route]] = {}
    replicas = (
        Replica.objects.exclude(state=Replica.State.STOPPED)
        .filter(job__state__in=ROUTABLE_JOB_STATES, job__node__isnull=False)
        .values_list("pk", "endpoint_id", "port", "state", "version", "job__node__name", "job__node__address")
    )
    for pk, endpoint_id, port, state, version, node, reported in replicas:
        routes.setdefault(endpoint_id, []).append(Route(pk, node_address(node, reported), port, state, version))
    unplaceable = Count(
        "replicas",
        filter=Q(replicas__job__state=JobState.QUEUED)
        & ~Q(replicas__state=Replica.State.STOPPED)
        & ~Q(replicas__job__pending_reason__in=("", FIRST_PASS_PENDING)),
    )
    table = {}
    active = Endpoint.objects.filter(state=Endpoint.State.ACTIVE).select_related("tenant")
    for e in active.annotate(unplaceable=unplaceable):
        table[(e.tenant.slug, e.name)] = EndpointRoute(
            e.pk,
            e.tenant_id,
            e.tenant.slug,
            e.name,
            e.health_path,
            e.version,
            e.idle_timeout_s,
            tuple(routes.get(e.pk, ())),
            e.max_replicas,
            e.unplaceable,
        )
    return table


def with_totals(endpoints: QuerySet[Endpoint]) -> QuerySet[Endpoint]:
    """``endpoints`` with ``cost_total`` (money) and ``gpu_ms_total`` of all their replicas so far,
    in the same query however many endpoints there are."""
    return endpoints.annotate(
        cost_total=Coalesce(Sum("replicas__job__cost"), Value(Decimal(0)), output_field=DecimalField()),
        gpu_ms_total=Coalesce(Sum("replicas__job__gpu_ms"), Value(0)),
    )


@scopes_disabled()
def replicas_serving(job_ids) -> dict[int, tuple[int, int]]:
    """For the jobs among ``job_ids`` that are live replicas: (their endpoint, how many of its replicas serve
    now: ready, their job running). The scheduler's defragmentation moves a replica only if others serve."""
    rows = list(
        Replica.objects.filter(job_id__in=list(job_ids))
        .exclude(state=Replica.State.STOPPED)
        .values_list("job_id", "endpoint_id")
    )
    if not rows:
        return {}
    serving = dict(
        Replica.objects.filter(
            endpoint_id__in={endpoint for _, endpoint in rows},
            state=Replica.State.READY,
            job__state__in=ROUTABLE_JOB_STATES,
        )
        .values("endpoint_id")
        .annotate(n=Count("id"))
        .values_list("endpoint_id", "n")
    )
    return {job_id: (endpoint, serving.get(endpoint, 0)) for job_id, endpoint in rows}
