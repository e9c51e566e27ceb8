"""Thin Celery entry points for the console."""

from celery import shared_task

from . import services


@shared_task(name="console.whatif_run", ignore_result=True, time_limit=900, soft_time_limit=870)
def whatif_run_task(*, run_id: int) -> None:
    services.whatif_run_execute(run_id=run_id)
