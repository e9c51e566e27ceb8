"""The report tasks node agents send (queue ``reports``), and the node watchdog.

Every report is checked against the protocol (agents.agent.protocol) and
attributed by the node credential it carries, never by a ``node`` field: a
report that fails either is refused, logged with the reason and recorded
(agents.LinkRefusal), never acted on. Once a report is stored its outbox
sequence numbers are acknowledged to the node (``agent.ack``), which then drops
them; a report never acknowledged is sent again, and every handler is
idempotent.

A worker runs these only from the report queue, and only these from it
(gpushare/celery.py's ReportGate): a platform task a node publishes there is
refused.
"""

from __future__ import annotations

import base64
import logging

from celery import shared_task
from django.db import OperationalError

from billing import services as billing_services
from scheduler import services as scheduler_services

from . import services
from .agent import protocol as p
from .dispatch import ack_send

log = logging.getLogger(__name__)

# A report whose transaction lost a deadlock or a lock timeout is retried with
# backoff (the services are idempotent); the agent would re-send it anyway after
# its resend timeout, as it is not acknowledged until stored.
RETRY = {"autoretry_for": (OperationalError,), "retry_backoff": 1, "retry_backoff_max": 60, "max_retries": 10}


def _report(task: str, kwargs: dict):
    """``(node, body, seqs)`` of a report that follows the protocol and whose credential is a node's; else None."""
    try:
        report = p.report_parse(task, kwargs)
    except p.ProtocolError as exc:
        sender = services.node_by_credential(kwargs.get("token") if isinstance(kwargs, dict) else None)
        services.link_refusal_record(node=sender, direction="report", task=task, reason=str(exc))
        if sender is not None:  # never storable: acknowledged, so the agent stops re-sending it
            seqs = kwargs.get("seqs")
            _ack(sender, [s for s in seqs if isinstance(s, int)] if isinstance(seqs, list) else [])
        return None
    node = services.node_by_credential(report.token)
    if node is None:
        services.link_refusal_record(node=None, direction="report", task=task, reason="unknown node credential")
        return None
    if report.claimed_node and report.claimed_node != node.name:
        # The credential says who sent it; a message naming another node is a forgery or a misconfiguration.
        services.link_refusal_record(
            node=node,
            direction="report",
            task=task,
            reason=f"sent with {node.name}'s credential but names node {report.claimed_node[:100]!r}",
        )
        _ack(node, report.seqs)
        return None
    return node, report.body, report.seqs


def _ack(node, seqs) -> None:
    if seqs:
        ack_send(node.name, seqs)


@shared_task(name=p.R_REGISTER, ignore_result=True, **RETRY)
def node_register_task(**kwargs) -> None:
    if found := _report(p.R_REGISTER, kwargs):
        node, body, seqs = found
        services.node_register(node=node, info=body["info"])
        _ack(node, seqs)


@shared_task(name=p.R_HEARTBEAT, ignore_result=True, **RETRY)
def node_heartbeat_task(**kwargs) -> None:
    if found := _report(p.R_HEARTBEAT, kwargs):
        node, body, seqs = found
        services.node_heartbeat(node=node, gpus=body["gpus"])
        _ack(node, seqs)


@shared_task(name=p.R_JOB_STARTED, ignore_result=True, **RETRY)
def job_started_task(**kwargs) -> None:
    if found := _report(p.R_JOB_STARTED, kwargs):
        node, body, seqs = found
        scheduler_services.job_started(node=node, job_id=body["job_id"], attempt=body["attempt"], at_ms=body["at_ms"])
        _ack(node, seqs)


@shared_task(name=p.R_JOB_EXITED, ignore_result=True, **RETRY)
def job_exited_task(**kwargs) -> None:
    if found := _report(p.R_JOB_EXITED, kwargs):
        node, body, seqs = found
        if body["windows"]:  # the job's last usage window: stored (idempotently) before the job ends
            billing_services.usage_windows_ingest(node=node, windows=body["windows"])
        scheduler_services.job_exited(
            node=node,
            job_id=body["job_id"],
            attempt=body["attempt"],
            exit_code=body["exit_code"],
            at_ms=body["at_ms"],
            reason=body["reason"],
            lost=body["lost"],
        )
        _ack(node, seqs)


@shared_task(name=p.R_USAGE, ignore_result=True, **RETRY)
def usage_windows_task(**kwargs) -> None:
    if found := _report(p.R_USAGE, kwargs):
        node, body, seqs = found
        billing_services.usage_windows_ingest(node=node, windows=body["windows"])
        _ack(node, seqs)


@shared_task(name=p.R_LOGS, ignore_result=True, **RETRY)
def job_logs_task(**kwargs) -> None:
    if found := _report(p.R_LOGS, kwargs):
        node, body, seqs = found
        try:
            data = base64.b64decode(body["data_b64"], validate=True)
        except ValueError:
            services.link_refusal_record(node=node, direction="report", task=p.R_LOGS, reason="data_b64 is not base64")
            _ack(node, seqs)  # never storable: re-sending it would not help
            return
        scheduler_services.job_logs_append(node=node, job_id=body["job_id"], offset=body["offset"], data=data)
        _ack(node, seqs)


@shared_task(name=p.R_GPU_HEALTH, ignore_result=True, **RETRY)
def gpu_health_task(**kwargs) -> None:
    if found := _report(p.R_GPU_HEALTH, kwargs):
        node, body, seqs = found
        services.gpu_health_record(node=node, uuid=body["uuid"], event=body["event"], at_ms=body["at_ms"] or None)
        _ack(node, seqs)


@shared_task(name=p.R_COMMAND_REFUSED, ignore_result=True, **RETRY)
def command_refused_task(**kwargs) -> None:
    """An agent refused a command (unsigned, expired, replayed, another node's...): counted in the fleet view."""
    if found := _report(p.R_COMMAND_REFUSED, kwargs):
        node, body, seqs = found
        services.link_refusal_record(
            node=node,
            direction="command",
            task=body["task"],
            reason=body["reason"],
            job_id=body["job_id"],
            dedupe=f"{node.pk}:{seqs[0]}:{body['nonce']}" if seqs else "",
        )
        _ack(node, seqs)


@shared_task(name="agents.check_nodes", ignore_result=True)
def node_down_check_task() -> list[str]:
    downed = services.node_down_check()
    services.node_drains_settle()
    return downed


@shared_task(name="agents.link_refusal", ignore_result=True, **RETRY)
def link_refusal_task(*, direction: str, task: str, reason: str) -> None:
    """A refusal the worker's report gate saw (it records it here, off its consumer thread)."""
    services.link_refusal_record(node=None, direction=direction, task=task, reason=reason)
