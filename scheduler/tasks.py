"""Thin Celery entry points for the scheduler."""

from celery import shared_task

from . import passes, services


@shared_task(name="scheduler.pass", ignore_result=True)
def schedule_pass_task() -> dict:
    passes.pass_flag_clear()
    result = services.schedule_pass()
    return {"placed": result.placed, "pending": result.pending}
