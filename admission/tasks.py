"""Thin Celery entry points for admission."""

from celery import shared_task

from . import services


@shared_task(name="admission.budgets_enforce", ignore_result=True)
def budgets_enforce_task() -> dict:
    return services.budgets_enforce()
