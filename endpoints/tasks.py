"""Thin Celery entry points for endpoints."""

from celery import shared_task

from accounts.tenant_tasks import TenantTask

from . import services


@shared_task(name="endpoints.autoscale", ignore_result=True)
def endpoint_autoscale_all_task() -> int:
    return services.endpoint_autoscale_all()


@shared_task(
    name="endpoints.autoscale_one",
    base=TenantTask,
    tenant_from=("endpoints.Endpoint", "endpoint_id"),
    ignore_result=True,
)
def endpoint_autoscale_task(endpoint_id: int) -> None:
    services.endpoint_autoscale(endpoint_id=endpoint_id)


@shared_task(name="endpoints.minutes_prune", ignore_result=True)
def endpoint_minutes_prune_task() -> int:
    return services.endpoint_minutes_prune()
