"""Celery tasks that node agents call (queue ``platform``), and the node watchdog.

Every message carries the node's name and credential; a message whose
credential does not match is dropped and logged, never acted on.
"""

from __future__ import annotations

import base64
import logging

from celery import shared_task
from django.db import OperationalError

from billing import services as billing_services
from scheduler import services as scheduler_services

from . import services
from .services import NodeAuthError

log = logging.getLogger(__name__)

# A report whose transaction lost a deadlock or a lock timeout is retried with
# backoff (the services are idempotent); the agent has already deleted it from
# its outbox, so dropping it would lose usage.
RETRY = {"autoretry_for": (OperationalError,), "retry_backoff": 1, "retry_backoff_max": 60, "max_retries": 10}


def _node(node: str, token: str):
    try:
        return services.node_authenticate(name=node, token=token)
    except NodeAuthError as exc:
        log.warning("%s; message dropped", exc)
        return None


@shared_task(name="agents.register", ignore_result=True, **RETRY)
def node_register_task(*, node: str, token: str, info: dict) -> None:
    if found := _node(node, token):
        services.node_register(node=found, info=info)


@shared_task(name="agents.heartbeat", ignore_result=True, **RETRY)
def node_heartbeat_task(*, node: str, token: str, gpus: list, at_ms: int = 0) -> None:
    if found := _node(node, token):
        services.node_heartbeat(node=found, gpus=gpus)


@shared_task(name="agents.job_started", ignore_result=True, **RETRY)
def job_started_task(*, node: str, token: str, job_id: int, attempt: int, at_ms: int) -> None:
    if found := _node(node, token):
        scheduler_services.job_started(node=found, job_id=job_id, attempt=attempt, at_ms=at_ms)


@shared_task(name="agents.job_exited", ignore_result=True, **RETRY)
def job_exited_task(
    *,
    node: str,
    token: str,
    job_id: int,
    attempt: int,
    exit_code: int | None,
    at_ms: int,
    reason: str = "",
    lost: bool = False,
    windows: list | None = None,
) -> None:
    if found := _node(node, token):
        if windows:  # the job's last usage window: stored (idempotently) before the job ends
            billing_services.usage_windows_ingest(node=found, windows=windows)
        scheduler_services.job_exited(
            node=found, job_id=job_id, attempt=attempt, exit_code=exit_code, at_ms=at_ms, reason=reason, lost=lost
        )


@shared_task(name="agents.usage", ignore_result=True, **RETRY)
def usage_windows_task(*, node: str, token: str, windows: list[dict]) -> None:
    if found := _node(node, token):
        billing_services.usage_windows_ingest(node=found, windows=windows)


@shared_task(name="agents.logs", ignore_result=True, **RETRY)
def job_logs_task(*, node: str, token: str, job_id: int, offset: int, data_b64: str) -> None:
    if found := _node(node, token):
        scheduler_services.job_logs_append(node=found, job_id=job_id, offset=offset, data=base64.b64decode(data_b64))


@shared_task(name="agents.gpu_health", ignore_result=True, **RETRY)
def gpu_health_task(*, node: str, token: str, uuid: str, event: dict, jobs: list | None = None, at_ms: int = 0) -> None:
    if found := _node(node, token):
        services.gpu_health_record(node=found, uuid=uuid, event=event, at_ms=at_ms or None)


@shared_task(name="agents.check_nodes", ignore_result=True)
def node_down_check_task() -> list[str]:
    downed = services.node_down_check()
    services.node_drains_settle()
    return downed
