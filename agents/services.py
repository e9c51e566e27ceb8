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

from scheduler import services as scheduler_services

from .models import Gpu, Node

log = logging.getLogger(__name__)


class NodeAuthError(Exception):
    pass


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


@transaction.atomic
def node_register(*, node: Node, info: dict) -> Node:
    """Record the node's GPUs and versions, reconcile what it still runs."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    node.agent_version = str(info.get("agent_version", ""))[:32]
    node.driver_version = str(info.get("driver_version", ""))[:32]
    node.cuda_version = str(info.get("cuda_version", ""))[:32]
    node.backend = str(info.get("backend", ""))[:16]
    node.registered_at = node.last_heartbeat_at = timezone.now()
    if node.state in (Node.State.PENDING, Node.State.DOWN):
        node.state = Node.State.UP
        node.state_reason = ""
    node.save()
    seen = set()
    for gpu in info.get("gpus", []):
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
            },
        )
    gone = node.gpus.exclude(uuid__in=seen)
    gone.update(health=Gpu.Health.OUT_OF_SERVICE, health_reason="not reported by the agent at registration")
    scheduler_services.node_reconcile(node=node, running=info.get("running", []))
    scheduler_services.schedule_soon()
    return node


@transaction.atomic
def node_heartbeat(*, node: Node, gpus: list[dict]) -> None:
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    if node.state == Node.State.DOWN:
        log.info("node %s is back; it must register again to be scheduled", node.name)
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
            locked = Node.objects.select_for_update().get(pk=node.pk)
            if locked.last_heartbeat_at >= cutoff or locked.state == Node.State.DOWN:
                continue
            reason = f"node {node.name} missed {conf['MISSED_HEARTBEATS_DOWN']} heartbeats"
            locked.state = Node.State.DOWN
            locked.state_reason = reason
            locked.save(update_fields=["state", "state_reason"])
            scheduler_services.node_jobs_lost(node=locked, reason=reason)
            downed.append(node.name)
    return downed
