"""Thin Celery entry points for webhook deliveries."""

from celery import shared_task

from accounts.tenant_tasks import TenantTask

from . import services


@shared_task(
    name="webhooks.deliver", base=TenantTask, tenant_from=("webhooks.Delivery", "delivery_id"), ignore_result=True
)
def delivery_send_task(*, delivery_id: int) -> None:
    services.delivery_send(delivery_id=delivery_id)


@shared_task(name="webhooks.deliveries_due", ignore_result=True)
def deliveries_due_task() -> int:
    """Queue every pending delivery whose next try is due (retries with backoff, lost enqueues)."""
    due = services.deliveries_due()
    for delivery_id in due:
        delivery_send_task.delay(delivery_id=delivery_id)
    return len(due)
