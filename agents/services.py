"""Platform-side handling of what node agents report. Each service is one transaction."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from accounts.services import audit_record
from scheduler import services as scheduler_services
from scheduler.models import ACTIVE_STATES, Job

from .agent.address import address_valid
from .agent.gpus import mig_layout
from .agent.health import event_describe, event_is_application_error, event_takes_gpu_out
from .dispatch import node_send
from .models import Gpu, GpuOutage, LinkRefusal, Node

log = logging.getLogger(__name__)


class NodeAuthError(Exception):
    pass


class NodeStateError(Exception):
    """An operator command the node's state does not allow."""


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@transaction.atomic
def node_credential_issue(*, name: str) -> str:
    """Create (or re-key) a node and return the agent token, shown once."""
    token = f"gpn_{secrets.token_urlsafe(32)}"
    node, created = Node.objects.get_or_create(name=name, defaults={"token_hash": _hash(token)})
    if not created:
        node.token_hash = _hash(token)
        node.save(update_fields=["token_hash"])
    return token


def node_authenticate(*, name: str, token: str) -> Node:
    node = Node.objects.filter(name=name).first()
    if node is None or not hmac.compare_digest(node.token_hash, _hash(token or "")):
        raise NodeAuthError(f"node {name!r} presented an unknown credential")
    return node


def node_by_credential(token) -> Node | None:
    """The node whose credential ``token`` is, or None: who sent a report, whatever the report says."""
    if not isinstance(token, str) or not token:
        return None
    digest = _hash(token)
    node = Node.objects.filter(token_hash=digest).first()
    if node is None or not hmac.compare_digest(node.token_hash, digest):
        return None
    return node


def link_refusal_record(
    *, node: Node | None, direction: str, reason: str, task: str = "", job_id=None, dedupe: str = ""
) -> LinkRefusal | None:
    """Record (and log) a message the node link refused; counted per node in the fleet view."""
    who = node.name if node else "an unknown sender"
    log.warning("node link: %s %r from %s refused: %s", direction, task[:100], who, reason)
    fields = {"node": node, "direction": direction, "task": task[:100], "reason": reason[:300], "job_id": job_id}
    if dedupe:
        refusal, _ = LinkRefusal.objects.get_or_create(dedupe=dedupe[:120], defaults=fields)
        return refusal
    return LinkRefusal.objects.create(**fields)


def _gpu_claim_refused(node: Node, uuid: str, owner: str) -> None:
    """A node reported a GPU UUID another node registered first: refused, and the operator is alerted."""
    reason = f"GPU {uuid[:96]} belongs to node {owner}; only an operator can move it"
    log.error("OPERATOR: node %s claimed GPU %s, which node %s registered first: refused", node.name, uuid, owner)
    audit_record(
        actor=None, tenant=None, action="gpu.claim_refused", target=f"{node.name}/{uuid[:96]}", after={"owner": owner}
    )
    link_refusal_record(node=node, direction=LinkRefusal.Direction.GPU_CLAIM, task="agents.register", reason=reason)


@transaction.atomic
def gpu_move(*, gpu: Gpu, to: Node, actor=None) -> Gpu:
    """The operator moves a GPU to another node (a card physically moved): the only way a UUID changes node."""
    gpu = Gpu.objects.select_for_update(no_key=True).select_related("node").get(pk=gpu.pk)
    before = gpu.node.name
    gpu.node = to
    gpu.save(update_fields=["node"])
    audit_record(
        actor=actor, tenant=None, action="gpu.move", target=gpu.uuid, before={"node": before}, after={"node": to.name}
    )
    return gpu


@transaction.atomic
def node_register(*, node: Node, info: dict) -> Node:
    """Record the node's GPUs and versions, reconcile what it still runs."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    node.agent_version = str(info.get("agent_version", ""))[:32]
    node.driver_version = str(info.get("driver_version", ""))[:32]
    node.cuda_version = str(info.get("cuda_version", ""))[:32]
    node.backend = str(info.get("backend", ""))[:16]
    node.address = _address_reported(node.name, info.get("address"))
    isolation = info.get("isolation")
    node.isolation = (
        {k: str(v)[:64] for k, v in isolation.items() if k in ("tenancy", "uid_pool", "network_policy", "job_egress")}
        if isinstance(isolation, dict)
        else {}
    )
    node.registered_at = node.last_heartbeat_at = timezone.now()
    if node.state in (Node.State.PENDING, Node.State.DOWN):
        held = node.state_before_down in (Node.State.CORDONED, Node.State.DRAINING)
        node.state = node.state_before_down if held else Node.State.UP
        node.state_reason = f"{node.state_before_down} before it went down" if held else ""
        node.state_before_down = ""
    node.save()
    _outages_close(node.gpus.all(), cause=GpuOutage.Cause.NODE_DOWN, at=node.registered_at)
    seen = set()
    owners = dict(
        Gpu.objects.filter(uuid__in=[g.get("uuid") for g in info.get("gpus", [])])
        .exclude(node=node)
        .values_list("uuid", "node__name")
    )
    for gpu in info.get("gpus", []):
        if gpu["uuid"] in owners:  # a GPU UUID belongs to the node that registered it first
            _gpu_claim_refused(node, gpu["uuid"], owners[gpu["uuid"]])
            continue
        seen.add(gpu["uuid"])
        Gpu.objects.update_or_create(
            uuid=gpu["uuid"],
            defaults={
                "node": node,
                "index": int(gpu["index"]),
                "model": str(gpu["model"])[:64],
                "memory_mb": int(gpu["memory_mb"]),
                "mig_mode": bool(gpu.get("mig_mode", False)),
                "isolation": str(gpu.get("isolation", "none"))[:8],
                "mig_instances": mig_layout(gpu),
            },
        )
    gone = node.gpus.exclude(uuid__in=seen)
    gone.update(health=Gpu.Health.OUT_OF_SERVICE, health_reason="not reported by the agent at registration")
    at_ms = info.get("at_ms")
    scheduler_services.node_reconcile(
        node=node, running=info.get("running", []), as_of_ms=at_ms if isinstance(at_ms, int) else None
    )
    scheduler_services.schedule_soon()
    return node


def _address_reported(node_name: str, address) -> str:
    """The address an agent reported for its replicas, or "" when it sent none or a malformed one.

    A bad address must not keep the node out of service (its training jobs
    need no address): it is dropped with a warning, and the gateway falls back
    to the operator's setting or 127.0.0.1.
    """
    if address is None or address == "":
        return ""  # an agent older than the address report
    if address_valid(address):
        return address
    log.warning("node %s reported a malformed address %.100r; ignored", node_name, address)
    return ""


@transaction.atomic
def node_heartbeat(*, node: Node, gpus: list[dict]) -> None:
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    if node.state == Node.State.DOWN:
        # The agent kept running (it hung, or its heartbeats were late) and does not
        # know the platform gave up on it: ask it to register, which reconciles its jobs.
        log.info("node %s is back after being marked down; asking its agent to register again", node.name)
        transaction.on_commit(lambda: node_send(node.name, "agent.register", {}))
    for gpu in gpus:
        Gpu.objects.filter(node=node, uuid=gpu.get("uuid")).update(last_metrics=gpu.get("metrics", {}))


def node_down_check() -> list[str]:
    """Mark nodes down after missed heartbeats; their jobs become lost."""
    conf = settings.GPUSHARE
    cutoff = timezone.now() - timedelta(seconds=conf["HEARTBEAT_INTERVAL_S"] * conf["MISSED_HEARTBEATS_DOWN"])
    downed = []
    stale = Node.objects.exclude(state__in=[Node.State.DOWN, Node.State.PENDING]).filter(last_heartbeat_at__lt=cutoff)
    for node in stale:
        with transaction.atomic():
            locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
            if locked.last_heartbeat_at >= cutoff or locked.state == Node.State.DOWN:
                continue
            reason = f"node {node.name} missed {conf['MISSED_HEARTBEATS_DOWN']} heartbeats"
            if locked.state in (Node.State.CORDONED, Node.State.DRAINING):
                locked.state_before_down = locked.state
            locked.state = Node.State.DOWN
            locked.state_reason = reason
            locked.save(update_fields=["state", "state_reason", "state_before_down"])
            scheduler_services.node_jobs_lost(node=locked, reason=reason)
            now = timezone.now()
            for gpu in locked.gpus.all():
                _outage_open(gpu, cause=GpuOutage.Cause.NODE_DOWN, reason=reason, at=now)
            audit_record(actor=None, tenant=None, action="node.down", target=node.name, after={"reason": reason})
            log.error("%s: marked down, its jobs lost", reason)
            downed.append(node.name)
    return downed


def _outage_open(gpu: Gpu, *, cause: str, reason: str, at) -> None:
    """Open an outage of ``cause`` for ``gpu`` unless one is already open."""
    if not GpuOutage.objects.filter(gpu=gpu, cause=cause, ended_at__isnull=True).exists():
        GpuOutage.objects.create(gpu=gpu, cause=cause, reason=reason[:200], started_at=at)


def _outages_close(gpus, *, cause: str, at) -> int:
    return GpuOutage.objects.filter(gpu__in=gpus, cause=cause, ended_at__isnull=True).update(ended_at=at)


# --- GPU health -------------------------------------------------------------


HEALTH_AUDIT_ACTIONS = ("gpu.out_of_service", "gpu.application_error")


@transaction.atomic
def gpu_health_record(*, node: Node, uuid: str, event: dict, at_ms: int | None = None) -> Gpu | None:
    """A health event from ``node``'s agent about its GPU ``uuid``.

    An application error (XID 13, 31, 43, 45, 68, 109) is logged and audited:
    the agent already stopped the job(s), which fail with the event as their
    reason. A hardware event takes the GPU out of service, opens a GpuOutage
    and alerts the operator (error log + audit entry).
    """
    gpu = Gpu.objects.select_for_update(no_key=True).filter(node=node, uuid=uuid).first()
    if gpu is None:
        log.warning("node %s reported a health event for GPU %s it does not have; ignored", node.name, uuid)
        return None
    description = event_describe(event)
    at = scheduler_services.ms_to_dt(at_ms) if at_ms else timezone.now()
    target = f"{node.name}/{uuid}"
    recorded = AuditLog.objects.filter(tenant=None, action__in=HEALTH_AUDIT_ACTIONS, target=target)
    if at_ms and recorded.filter(after__event=event, after__at_ms=at_ms).exists():
        # A re-sent report (its acknowledgement was lost): already acted on. Acting again would
        # write a second audit row, or take a GPU the operator has since returned out again.
        log.info("GPU %s on %s: %s at %s already recorded; re-sent report ignored", uuid, node.name, description, at_ms)
        return gpu
    if event_takes_gpu_out(event):
        before = {"health": gpu.health, "reason": gpu.health_reason}
        gpu.health = Gpu.Health.OUT_OF_SERVICE
        gpu.health_reason = f"{description} at {at:%Y-%m-%d %H:%M:%S} UTC"[:200]
        gpu.save(update_fields=["health", "health_reason"])
        _outage_open(gpu, cause=GpuOutage.Cause.HEALTH, reason=description, at=at)
        audit_record(
            actor=None,
            tenant=None,
            action="gpu.out_of_service",
            target=target,
            before=before,
            after={"health": gpu.health, "reason": gpu.health_reason, "event": event, "at_ms": at_ms},
        )
        log.error("OPERATOR: GPU %s on %s taken out of service: %s", uuid, node.name, description)
    elif event_is_application_error(event):
        after = {"event": event, "at_ms": at_ms}
        audit_record(actor=None, tenant=None, action="gpu.application_error", target=target, after=after)
        log.warning("GPU %s on %s: %s; its job(s) fail, the GPU stays in service", uuid, node.name, description)
    else:
        log.info("GPU %s on %s: %s", uuid, node.name, description)
    return gpu


@transaction.atomic
def gpu_return_to_service(*, gpu: Gpu, actor=None, note: str = "") -> Gpu:
    """The operator checked (or replaced) the GPU: back in the pool, its outage closed."""
    gpu = Gpu.objects.select_for_update(no_key=True).select_related("node").get(pk=gpu.pk)
    before = {"health": gpu.health, "reason": gpu.health_reason}
    gpu.health = Gpu.Health.OK
    gpu.health_reason = ""
    gpu.save(update_fields=["health", "health_reason"])
    _outages_close([gpu], cause=GpuOutage.Cause.HEALTH, at=timezone.now())
    audit_record(
        actor=actor,
        tenant=None,
        action="gpu.return_to_service",
        target=f"{gpu.node.name}/{gpu.uuid}",
        before=before,
        after={"health": gpu.health, "note": note},
    )
    scheduler_services.schedule_soon()
    return gpu


# --- operator node commands --------------------------------------------------


def _node_state_set(node: Node, *, to: str, actor, action: str, reason: str) -> Node:
    before = node.state
    node.state = to
    node.state_reason = reason[:200]
    node.save(update_fields=["state", "state_reason"])
    audit_record(
        actor=actor,
        tenant=None,
        action=action,
        target=node.name,
        before={"state": before},
        after={"state": to, "reason": node.state_reason},
    )
    return node


def _active_jobs(node: Node) -> int:
    with scopes_disabled():  # a node's jobs, of every tenant
        return Job.objects.filter(node=node, state__in=ACTIVE_STATES).count()


@transaction.atomic
def node_cordon(*, node: Node, actor=None, reason: str = "") -> Node:
    """No new jobs on ``node``; what runs there keeps running."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state not in (Node.State.UP, Node.State.DRAINING, Node.State.CORDONED):
        raise NodeStateError(f"node {node.name} is {node.state}: only an up or draining node can be cordoned")
    return _node_state_set(
        node, to=Node.State.CORDONED, actor=actor, action="node.cordon", reason=reason or "cordoned by the operator"
    )


@transaction.atomic
def node_drain(*, node: Node, actor=None, reason: str = "") -> Node:
    """No new jobs on ``node``; it becomes cordoned once its last job ends."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state not in (Node.State.UP, Node.State.DRAINING):
        raise NodeStateError(f"node {node.name} is {node.state}: only an up node can be drained")
    node = _node_state_set(
        node,
        to=Node.State.DRAINING,
        actor=actor,
        action="node.drain",
        reason=reason or "draining: cordoned once its jobs end",
    )
    if _active_jobs(node) == 0:
        node = _node_state_set(
            node, to=Node.State.CORDONED, actor=None, action="node.drained", reason="drained: no jobs left"
        )
    return node


@transaction.atomic
def node_uncordon(*, node: Node, actor=None) -> Node:
    """Back in the pool."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state not in (Node.State.CORDONED, Node.State.DRAINING, Node.State.UP):
        raise NodeStateError(f"node {node.name} is {node.state}: only a cordoned or draining node can be uncordoned")
    node = _node_state_set(node, to=Node.State.UP, actor=actor, action="node.uncordon", reason="")
    scheduler_services.schedule_soon()
    return node


def node_drains_settle() -> list[str]:
    """Draining nodes whose last job ended become cordoned (run by agents.check_nodes)."""
    settled = []
    for node in Node.objects.filter(state=Node.State.DRAINING):
        with transaction.atomic():
            locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
            if locked.state == Node.State.DRAINING and _active_jobs(locked) == 0:
                _node_state_set(
                    locked, to=Node.State.CORDONED, actor=None, action="node.drained", reason="drained: no jobs left"
                )
                settled.append(node.name)
    return settled
