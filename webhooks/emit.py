"""One call per place where the platform reports something to tenants' webhooks.

Each is called inside the transaction of the change (the event is stored with
it) and costs one indexed query when the tenant has no webhook for it.
"""

from __future__ import annotations

import json

from .models import Webhook


def active_hooks_sql(tenant_id: str) -> str:
    """SQL (PostgreSQL) for the active webhooks of the tenant whose id is ``tenant_id`` (SQL), as JSON text
    ``[[id, patterns], ...]`` in id order: read by a statement the caller runs anyway (a submit's insert)
    and handed to :func:`job_state_changed` as ``active_hooks`` (:func:`active_hooks_from`), emitting then
    costs no statement of its own when no webhook subscribes."""
    table = Webhook._meta.db_table
    return f"""(SELECT coalesce(json_agg(json_build_array(w.id, w.events) ORDER BY w.id), '[]')::text
        FROM {table} w WHERE w.tenant_id = {tenant_id} AND w.active)"""


def active_hooks_from(text: str) -> list[tuple[int, list]]:
    return [(pk, patterns) for pk, patterns in json.loads(text)]


def event_emit(**kwargs) -> None:
    # Imported here: the services this module is called from are imported by webhooks.services' own imports.
    from .services import event_emit as emit

    emit(**kwargs)


def job_state_changed(job, *, from_state: str | None, detail: str = "", active_hooks=None) -> None:
    """``job.<state>`` for a job that just became ``job.state``; ``active_hooks``: the tenant's, if the
    caller read them in its transaction (:func:`active_hooks_sql`)."""
    event_emit(
        active_hooks=active_hooks,
        tenant_id=job.tenant_id,
        type=f"job.{job.state}",
        data={
            "job": job.pk,
            "name": job.name,
            "kind": job.kind,
            "state": job.state,
            "from_state": from_state,
            "exit_code": job.exit_code,
            "detail": detail,
        },
    )


def jobs_scheduled(rows) -> None:
    """``job.scheduled`` for a scheduling pass's placements: rows of (tenant_id, job_id, at, from, to, detail)."""
    tenants = {row[0] for row in rows}
    subscribed = set(Webhook.objects.filter(tenant_id__in=tenants, active=True).values_list("tenant_id", flat=True))
    for tenant_id, job_id, _, from_state, to_state, detail in rows:
        if tenant_id in subscribed:
            data = {"job": job_id, "state": to_state, "from_state": from_state, "detail": detail}
            event_emit(tenant_id=tenant_id, type="job.scheduled", data=data)


def endpoint_scaled(endpoint, *, from_replicas: int, to_replicas: int, reason: str) -> None:
    data = {"endpoint": endpoint.pk, "name": endpoint.name, "from": from_replicas, "to": to_replicas, "reason": reason}
    event_emit(tenant_id=endpoint.tenant_id, type="endpoint.scaled", data=data)


def endpoint_replica_failed(endpoint, replica) -> None:
    """A replica whose job failed or was lost (a replica drained on purpose is not a failure)."""
    job = replica.job
    if job.state not in ("failed", "lost"):
        return
    data = {
        "endpoint": endpoint.pk,
        "name": endpoint.name,
        "replica": replica.pk,
        "job": job.pk,
        "job_state": job.state,
        "exit_code": job.exit_code,
        "reason": job.stop_reason,
    }
    event_emit(tenant_id=endpoint.tenant_id, type="endpoint.failed", data=data)


def budget(tenant, *, kind: str, month, status: dict) -> None:
    """``budget.threshold`` or ``budget.exhausted``, at most once per tenant and month."""
    event_emit(
        tenant_id=tenant.pk,
        type=f"budget.{kind}",
        data={"month": f"{month:%Y-%m}", **status},
        dedupe_key=f"budget.{kind}:{month:%Y-%m}",
    )


INVOICE_EVENTS = {"open": "invoice.issued", "paid": "invoice.paid", "payment_failed": "invoice.payment_failed"}


def invoice_state_changed(invoice) -> None:
    kind = INVOICE_EVENTS.get(invoice.state)
    if kind is None:
        return
    data = {
        "invoice": invoice.pk,
        "month": f"{invoice.month:%Y-%m}",
        "state": invoice.state,
        "total": str(invoice.total),
        "currency": invoice.currency,
    }
    event_emit(tenant_id=invoice.tenant_id, type=kind, data=data, dedupe_key=f"{kind}:{invoice.pk}")
