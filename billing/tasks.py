"""Thin Celery entry points for billing: each takes ids, calls one service, is safe to run twice."""

from __future__ import annotations

from celery import shared_task
from django.db import transaction
from django.utils import timezone

from accounts.tenant_tasks import TenantTask

from . import gateway, rating
from .selectors import month_parse
from .services import invoices, payments


# Long by nature: may outlive the broker's visibility timeout and be delivered
# again; closes are idempotent and serialised per tenant, so that is harmless.
@shared_task(name="billing.close_month", ignore_result=True, time_limit=3600, soft_time_limit=3500)
def close_month_task(*, month: str = "") -> int:
    """Close ``month`` (YYYY-MM; default: the month before now), then send each new invoice to Stripe."""
    first_day = month_parse(month) if month else rating.month_to_close(now_ms=int(timezone.now().timestamp() * 1000))
    if first_day is None:
        return 0  # let the last windows of the month arrive first
    closed = invoices.invoices_close_month(month=first_day)
    for invoice in closed:
        if invoice.state == invoice.State.DRAFT:
            transaction.on_commit(lambda pk=invoice.pk: invoice_send_task.delay(invoice_id=pk))
    return len(closed)


@shared_task(
    name="billing.invoice_send",
    base=TenantTask,
    tenant_from=("billing.Invoice", "invoice_id"),
    bind=True,
    ignore_result=True,
    max_retries=8,
)
def invoice_send_task(self, *, invoice_id: int) -> None:
    """Send and collect; Stripe being unreachable is retried with backoff (idempotency keys make it safe)."""
    try:
        payments.invoice_send(invoice_id=invoice_id)
    except gateway.GatewayError as exc:
        if not exc.transient:
            raise
        raise self.retry(exc=exc, countdown=min(3600, 30 * 2**self.request.retries)) from exc


@shared_task(name="billing.dunning_check", ignore_result=True)
def dunning_check_task() -> int:
    return len(payments.dunning_check())
