"""Writes for endpoints and their replicas. Each service is one transaction.

A replica is a job: starting one is ``job_submit``, stopping one is
``job_cancel``; the scheduler, agent and billing treat it like any job.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant
from accounts.services import audit_record
from accounts.tenancy import acts_for_tenant, tenant_scope
from scheduler import services as scheduler_services
from scheduler.models import TERMINAL_STATES, JobKind, JobState
from webhooks import emit as webhook_emit

from .admission import endpoint_admit
from .autoscale import Load, desired_replicas
from .models import Endpoint, EndpointLoad, EndpointMinute, Replica, ScalingEvent

log = logging.getLogger(__name__)

PORT_RANGE = (20000, 29999)
DRAIN_TIMEOUT = timedelta(seconds=60)
REPLICA_MAX_RUNTIME_S = 30 * 24 * 3600
RUNTIME_FIELDS = ("command", "image", "env", "gpu_milli", "gpu_model", "priority", "health_path")


class EndpointError(Exception):
    def __init__(self, message: str, *, code: str = "invalid", field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    command: list[str]
    gpu_milli: int
    image: str = ""
    env: dict[str, str] = field(default_factory=dict)
    gpu_model: str = ""
    priority: str = ""
    min_replicas: int = 0
    max_replicas: int = 1
    concurrency_target: int = 4
    idle_timeout_s: int = 60
    health_path: str = "/health"


def _validate(values: dict) -> None:
    if values["min_replicas"] > values["max_replicas"]:
        raise EndpointError("min_replicas must not exceed max_replicas", field="min_replicas")
    if values["max_replicas"] < 1:
        raise EndpointError("max_replicas must be at least 1", field="max_replicas")
    if not str(values["health_path"]).startswith("/"):
        raise EndpointError("health_path must start with /", field="health_path")
    try:
        scheduler_services.job_mode_for(kind=JobKind.INFERENCE, gpu_milli=values["gpu_milli"])
    except scheduler_services.JobError as exc:
        raise EndpointError(str(exc), field="gpus") from exc
    if values["priority"]:
        scheduler_services.priority_for(kind=JobKind.INFERENCE, name=values["priority"])


def _admission_values(values: dict) -> dict:
    return {k: values[k] for k in ("gpu_milli", "gpu_model", "priority", "max_replicas")}


@transaction.atomic
def endpoint_create(*, tenant: Tenant, user, spec: EndpointSpec) -> Endpoint:
    values = {k: getattr(spec, k) for k in EndpointSpec.__dataclass_fields__}
    _validate(values)
    endpoint_admit(tenant=tenant, endpoint_id=None, **_admission_values(values))
    with tenant_scope(tenant):
        if Endpoint.objects.filter(tenant=tenant, name=spec.name, state=Endpoint.State.ACTIVE).exists():
            raise EndpointError(f"an endpoint named {spec.name!r} already exists", code="conflict", field="name")
        endpoint = Endpoint.objects.create(
            tenant=tenant, created_by=user if getattr(user, "pk", None) else None, **values
        )
        EndpointLoad.objects.create(endpoint=endpoint)
    audit_record(actor=user, tenant=tenant, action="endpoint.create", target=spec.name, after=_snapshot(endpoint))
    transaction.on_commit(lambda: _autoscale_soon(endpoint.pk))
    return endpoint


def _snapshot(endpoint: Endpoint) -> dict:
    return {
        f: getattr(endpoint, f)
        for f in (*RUNTIME_FIELDS, "min_replicas", "max_replicas", "concurrency_target", "idle_timeout_s", "version")
    }


@transaction.atomic
def endpoint_update(*, endpoint: Endpoint, user, changes: dict) -> Endpoint:
    """Change an endpoint; a change of what replicas run is a rolling update (new version)."""
    with tenant_scope(endpoint):
        endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = _snapshot(endpoint)
        values = {**before, **changes}
        values.pop("version")
        _validate(values)
        endpoint_admit(tenant=endpoint.tenant, endpoint_id=endpoint.pk, **_admission_values(values))
        for key, value in changes.items():
            setattr(endpoint, key, value)
        if any(before[f] != getattr(endpoint, f) for f in RUNTIME_FIELDS):
            endpoint.version += 1
        endpoint.save()
    audit_record(
        actor=user,
        tenant=endpoint.tenant,
        action="endpoint.update",
        target=endpoint.name,
        before=before,
        after=_snapshot(endpoint),
    )
    transaction.on_commit(lambda: _autoscale_soon(endpoint.pk))
    return endpoint


@transaction.atomic
def endpoint_delete(*, endpoint: Endpoint, user) -> Endpoint:
    with tenant_scope(endpoint):
        endpoint = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        endpoint.state = Endpoint.State.DELETED
        endpoint.save(update_fields=["state", "updated_at"])
    audit_record(actor=user, tenant=endpoint.tenant, action="endpoint.delete", target=endpoint.name)
    transaction.on_commit(lambda: _autoscale_soon(endpoint.pk))
    return endpoint


def _autoscale_soon(endpoint_id: int) -> None:
    from .tasks import endpoint_autoscale_task

    endpoint_autoscale_task.delay(endpoint_id)


def _port_pick() -> int:
    with scopes_disabled():  # the ports are shared by every tenant's replicas
        used = set(Replica.objects.exclude(state=Replica.State.STOPPED).values_list("port", flat=True))
    free = [p for p in range(*PORT_RANGE) if p not in used]
    if not free:
        raise EndpointError("no free replica port", code="conflict")
    return random.choice(free)


def _replica_start(endpoint: Endpoint) -> Replica:
    port = _port_pick()
    spec = scheduler_services.JobSpec(
        kind=JobKind.INFERENCE,
        gpu_milli=endpoint.gpu_milli,
        command=list(endpoint.command),
        name=f"endpoint {endpoint.name} v{endpoint.version}",
        env={**endpoint.env, "PORT": str(port)},
        image=endpoint.image,
        gpu_model=endpoint.gpu_model,
        priority=endpoint.priority or "serving",
        max_runtime_s=REPLICA_MAX_RUNTIME_S,
        endpoint_id=endpoint.pk,
    )
    job = scheduler_services.job_submit(tenant=endpoint.tenant, user=endpoint.created_by, spec=spec)
    with transaction.atomic():  # a savepoint: a port taken concurrently fails only this insert
        return Replica.objects.create(
            tenant=endpoint.tenant, endpoint=endpoint, job=job, version=endpoint.version, port=port
        )


def _replica_drain(replica: Replica, now) -> None:
    """No new requests go to it; a replica not serving yet is stopped at once."""
    if replica.state == Replica.State.STARTING:
        scheduler_services.job_cancel(job=replica.job, reason="endpoint scaled down before the replica was ready")
    replica.state = Replica.State.DRAINING
    replica.drain_started_at = now
    replica.save(update_fields=["state", "drain_started_at"])


@dataclass
class AutoscaleResult:
    started: int = 0
    drained: int = 0
    stopped: int = 0


@acts_for_tenant(("endpoints.Endpoint", "endpoint_id"))
def endpoint_autoscale(*, endpoint_id: int) -> AutoscaleResult:
    """Bring one endpoint's replicas in line with its load and version."""
    try:
        with transaction.atomic():
            return _autoscale(endpoint_id)
    except IntegrityError:  # two passes picked the same port: the next pass fixes it
        log.info("autoscale of endpoint %s raced; retrying on the next pass", endpoint_id)
        return AutoscaleResult()


def _autoscale(endpoint_id: int) -> AutoscaleResult:
    result = AutoscaleResult()
    endpoint = Endpoint.objects.select_for_update().select_related("tenant").filter(pk=endpoint_id).first()
    if endpoint is None:
        return result
    now = timezone.now()
    load = EndpointLoad.objects.filter(endpoint=endpoint).first() or EndpointLoad(endpoint=endpoint)
    replicas = list(endpoint.replicas.exclude(state=Replica.State.STOPPED).select_related("job"))
    # Replicas whose job ended (crashed, lost, cancelled) are gone.
    for replica in replicas:
        if replica.job.state in TERMINAL_STATES or replica.job.state == JobState.PREEMPTED:
            replica.state = Replica.State.STOPPED
            replica.stopped_at = now
            replica.save(update_fields=["state", "stopped_at"])
            webhook_emit.endpoint_replica_failed(endpoint, replica)
            result.stopped += 1
    live = [r for r in replicas if r.state != Replica.State.STOPPED]
    current = [
        r for r in live if r.version == endpoint.version and r.state in (Replica.State.STARTING, Replica.State.READY)
    ]
    old = [
        r for r in live if r.version != endpoint.version and r.state in (Replica.State.STARTING, Replica.State.READY)
    ]

    if endpoint.state == Endpoint.State.DELETED:
        want = 0
        reason = "endpoint deleted"
    else:
        idle_ms = int((now - load.last_request_at).total_seconds() * 1000) if load.last_request_at else None
        decision = desired_replicas(
            Load(
                inflight=load.inflight,
                queued=load.queued,
                peak=load.peak_concurrency,
                idle_ms=idle_ms,
                current=len(current),
                min_replicas=endpoint.min_replicas,
                max_replicas=endpoint.max_replicas,
                target=endpoint.concurrency_target,
                idle_timeout_ms=endpoint.idle_timeout_s * 1000,
            )
        )
        want, reason = decision.replicas, decision.reason
    if want != len(current):
        ScalingEvent.objects.create(
            tenant=endpoint.tenant, endpoint=endpoint, from_replicas=len(current), to_replicas=want, reason=reason
        )
        webhook_emit.endpoint_scaled(endpoint, from_replicas=len(current), to_replicas=want, reason=reason)
    for _ in range(want - len(current)):
        _replica_start(endpoint)
        result.started += 1
    if want < len(current):
        # Stop the ones not serving yet first, then the least busy.
        busy = {int(k): v for k, v in (load.replica_inflight or {}).items()}
        order = sorted(current, key=lambda r: (r.state == Replica.State.READY, busy.get(r.pk, 0), -r.pk))
        for replica in order[: len(current) - want]:
            _replica_drain(replica, now)
            result.drained += 1
    # Rolling update: old versions drain once the new version serves as many.
    ready_new = sum(1 for r in current if r.state == Replica.State.READY)
    old_ready = [r for r in old if r.state == Replica.State.READY]
    if old and (
        ready_new >= min(len(old_ready), max(want, 1)) or endpoint.state == Endpoint.State.DELETED or want == 0
    ):
        for replica in old:
            _replica_drain(replica, now)
            result.drained += 1
    # Draining replicas stop once the gateway sees nothing in flight on them.
    busy = {int(k): v for k, v in (load.replica_inflight or {}).items()}
    for replica in endpoint.replicas.filter(state=Replica.State.DRAINING).select_related("job"):
        if replica.job.stop_requested:
            continue
        if busy.get(replica.pk, 0) == 0 or now - replica.drain_started_at > DRAIN_TIMEOUT:
            scheduler_services.job_cancel(job=replica.job, reason="endpoint replica drained")
            result.stopped += 1
    return result


def endpoint_autoscale_all() -> int:
    """One autoscaling pass over active endpoints and deleted ones with replicas left; returns how
    many replicas it started, drained or stopped (0 when nothing changed: the pass's log line stays quiet)."""
    with scopes_disabled():  # the beat: every tenant's endpoints (each is then scaled in its own scope)
        ids = set(Endpoint.objects.filter(state=Endpoint.State.ACTIVE).values_list("pk", flat=True))
        ids |= set(Replica.objects.exclude(state=Replica.State.STOPPED).values_list("endpoint_id", flat=True))
    changed = 0
    for endpoint_id in sorted(ids):
        result = endpoint_autoscale(endpoint_id=endpoint_id)
        changed += result.started + result.drained + result.stopped
    return changed


@acts_for_tenant(("endpoints.Replica", "replica_id"))
@transaction.atomic
def replica_ready_set(*, replica_id: int, ready: bool) -> None:
    """The gateway's health check answered (or stopped answering)."""
    replica = Replica.objects.select_for_update().filter(pk=replica_id).first()
    if replica is None:
        return
    if ready and replica.state == Replica.State.STARTING:
        replica.state = Replica.State.READY
        replica.ready_at = timezone.now()
        replica.save(update_fields=["state", "ready_at"])
    elif not ready and replica.state == Replica.State.READY:
        replica.state = Replica.State.STARTING
        replica.save(update_fields=["state"])


@acts_for_tenant(("endpoints.Endpoint", "endpoint_id"))
@transaction.atomic
def endpoint_load_record(*, endpoint_id: int, stats: dict) -> None:
    """The gateway's view of an endpoint's traffic, once a second (an endpoint gone meanwhile is skipped)."""
    tenant_id = Endpoint.objects.filter(pk=endpoint_id).values_list("tenant_id", flat=True).first()
    if tenant_id is None:
        return
    fields = {
        "inflight": int(stats.get("inflight", 0)),
        "queued": int(stats.get("queued", 0)),
        "peak_concurrency": int(stats.get("peak", 0)),
        "requests_total": int(stats.get("requests_total", 0)),
        "errors_total": int(stats.get("errors_total", 0)),
        "replica_inflight": {str(k): int(v) for k, v in stats.get("replica_inflight", {}).items()},
        "latency_ms": stats.get("latency_ms", {}),
    }
    if stats.get("last_request_at") is not None:
        fields["last_request_at"] = stats["last_request_at"]
    EndpointLoad.objects.update_or_create(endpoint_id=endpoint_id, defaults=fields)
    _minutes_record(tenant_id, endpoint_id, stats.get("minutes") or [])


def _latency(summary: dict, key: str) -> int | None:
    value = (summary.get("latency_ms") or {}).get(key)
    return None if value is None else max(0, round(value))


def _minutes_record(tenant_id: int, endpoint_id: int, minutes: list[dict]) -> None:
    """Upsert whole minutes (a repeated report rewrites its row: nothing counts twice)."""
    if not minutes:
        return
    rows = [
        EndpointMinute(
            tenant_id=tenant_id,
            endpoint_id=endpoint_id,
            minute=datetime.fromtimestamp(int(m["minute"]) // 60 * 60, tz=UTC),
            requests=max(0, int(m.get("requests", 0))),
            errors=max(0, int(m.get("errors", 0))),
            peak_concurrency=max(0, int(m.get("peak", 0))),
            p50_ms=_latency(m, "p50"),
            p95_ms=_latency(m, "p95"),
            p99_ms=_latency(m, "p99"),
        )
        for m in minutes
    ]
    EndpointMinute.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["endpoint", "minute"],
        update_fields=["requests", "errors", "peak_concurrency", "p50_ms", "p95_ms", "p99_ms"],
    )


@scopes_disabled()  # the beat: every tenant's old traffic minutes
def endpoint_minutes_prune(*, keep_days: int = 30) -> int:
    """Forget traffic history older than ``keep_days`` (the bill keeps its own records)."""
    cutoff = timezone.now() - timedelta(days=keep_days)
    deleted, _ = EndpointMinute.objects.filter(minute__lt=cutoff).delete()
    return deleted
