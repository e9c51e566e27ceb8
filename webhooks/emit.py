"""One call per place where the platform reports something to tenants' webhooks.

Each is called inside the transaction of the change (the event is stored with
it) and costs one indexed query when the tenant has no webhook for it.
"""

from __future__ import annotations

from .models import Webhook


def event_emit(**kwargs) -> None:
    # Imported here: the services this module is called from are imported by webhooks.services' own imports.
    from .services import event_emit as emit

    emit(**kwargs)


def job_state_changed(job, *, from_state: str | None, detail: str = "") -> None:
    """``job.<state>`` for a job that just became ``job.state``."""
    event_emit(
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
