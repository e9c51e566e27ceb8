"""Thin Celery entry points for the scheduler."""

from celery import shared_task

from gpushare.observability.metrics import scheduler_pass_observe

from . import counts, passes, services


@shared_task(name="scheduler.pass", ignore_result=True)
def schedule_pass_task() -> dict:
    passes.pass_started()
    result = services.schedule_pass()
    passes.pass_finished(result.seconds, progressed=result.progressed)
    counts.changes_vacuum(result.folded)  # after the pass's transaction: its dead rows, now and then
    scheduler_pass_observe(result)  # duration and placements (gpushare/observability/metrics.py)
    return {"placed": result.placed, "pending": result.pending}


@shared_task(name="scheduler.launches_resend", ignore_result=True)
def launches_resend_task() -> int:
    return passes.launches_resend()
