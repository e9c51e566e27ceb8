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
from gpushare.db.durability import flushed_once
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


def report_task(name: str):
    """A report handler ``handle(node, body, seqs)`` as the Celery task ``name``: the report is parsed and
    attributed first (:func:`_report`; a refused one never reaches the handler), acknowledged once handled."""

    def wrap(handle):
        def task(**kwargs) -> None:
            if found := _report(name, kwargs):
                node, body, seqs = found
                handle(node, body, seqs)
                _ack(node, seqs)

        task.__name__, task.__qualname__, task.__doc__ = handle.__name__, handle.__qualname__, handle.__doc__
        task.__module__ = handle.__module__
        return shared_task(name=name, ignore_result=True, **RETRY)(task)

    return wrap


@report_task(p.R_REGISTER)
def node_register_task(node, body, seqs) -> None:
    services.node_register(node=node, info=body["info"])


@report_task(p.R_HEARTBEAT)
def node_heartbeat_task(node, body, seqs) -> None:
    services.node_heartbeat(node=node, gpus=body["gpus"])


def _job_started(node, body) -> None:
    scheduler_services.job_started(node=node, job_id=body["job_id"], attempt=body["attempt"], at_ms=body["at_ms"])


def _windows_store(node, windows: list) -> None:
    """Exits' last usage windows, stored (idempotently, one ingest) before their jobs end."""
    if windows:
        billing_services.usage_windows_ingest(node=node, windows=windows)


def _job_exited(node, body) -> None:
    _windows_store(node, body["windows"])
    _job_ended(node, body)


def _job_ended(node, body) -> None:
    scheduler_services.job_exited(
        node=node,
        job_id=body["job_id"],
        attempt=body["attempt"],
        exit_code=body["exit_code"],
        at_ms=body["at_ms"],
        reason=body["reason"],
        lost=body["lost"],
    )


# A batch's exits have their windows stored together first (job_events_task): then each job ends.
JOB_EVENT_HANDLERS = {p.R_JOB_STARTED: _job_started, p.R_JOB_EXITED: _job_ended}


@report_task(p.R_JOB_STARTED)
def job_started_task(node, body, seqs) -> None:
    _job_started(node, body)


@report_task(p.R_JOB_EXITED)
def job_exited_task(node, body, seqs) -> None:
    _job_exited(node, body)


@report_task(p.R_JOB_EVENTS)
def job_events_task(node, body, seqs) -> None:
    """Consecutive starts and exits of one node, in its order, each in its own transaction (a retry of the
    batch after a lost deadlock acts again only on what was not stored: the handlers are idempotent), which
    do not each wait for the disk: the batch waits once, before it is acknowledged (``flushed_once``).
    A malformed event is refused alone and recorded; the batch is acknowledged as a whole once handled.

    The exits' last usage windows are all stored first, as one ingest batch (one transaction and a fixed
    number of statements, however many exits): each is still stored before its job ends. One ingest per
    exit cost ~6 ms of the ~10 ms an exit took, and made the end of a wave of short jobs (an array's
    tasks) wait ~0.4 s more for the pass that places the next wave."""
    events = []
    for event in body["events"]:
        try:
            events.append(p.job_event_parse(event))
        except p.ProtocolError as exc:
            services.link_refusal_record(node=node, direction="report", task=p.R_JOB_EVENTS, reason=str(exc))
    with flushed_once():  # one wait for the disk for the batch, before its acknowledgement
        _windows_store(node, [w for task, fields in events if task == p.R_JOB_EXITED for w in fields["windows"]])
        for task, fields in events:
            JOB_EVENT_HANDLERS[task](node, fields)


@report_task(p.R_USAGE)
def usage_windows_task(node, body, seqs) -> None:
    billing_services.usage_windows_ingest(node=node, windows=body["windows"])


@report_task(p.R_LOGS)
def job_logs_task(node, body, seqs) -> None:
    try:
        data = base64.b64decode(body["data_b64"], validate=True)
    except ValueError:  # never storable: recorded, and acknowledged like any report (re-sending would not help)
        services.link_refusal_record(node=node, direction="report", task=p.R_LOGS, reason="data_b64 is not base64")
        return
    scheduler_services.job_logs_append(node=node, job_id=body["job_id"], offset=body["offset"], data=data)


@report_task(p.R_GPU_HEALTH)
def gpu_health_task(node, body, seqs) -> None:
    services.gpu_health_record(node=node, uuid=body["uuid"], event=body["event"], at_ms=body["at_ms"] or None)


@report_task(p.R_COMMAND_REFUSED)
def command_refused_task(node, body, seqs) -> None:
    """An agent refused a command (unsigned, expired, replayed, another node's...): counted in the fleet view."""
    services.link_refusal_record(
        node=node,
        direction="command",
        task=body["task"],
        reason=body["reason"],
        job_id=body["job_id"],
        dedupe=f"{node.pk}:{seqs[0]}:{body['nonce']}" if seqs else "",
    )


@shared_task(name="agents.check_nodes", ignore_result=True)
def node_down_check_task() -> list[str]:
    downed = services.node_down_check()
    services.node_drains_settle()
    return downed


@shared_task(name="agents.link_refusal", ignore_result=True, **RETRY)
def link_refusal_task(*, direction: str, task: str, reason: str) -> None:
    """A refusal the worker's report gate saw (it records it here, off its consumer thread)."""
    services.link_refusal_record(node=None, direction=direction, task=task, reason=reason)
