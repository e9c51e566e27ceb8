from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    verbose_name = "Jobs and scheduling"

    def ready(self) -> None:
        """Provide what accounts (below) asks of the scheduler: stopping a tenant's jobs, a pass soon."""
        from accounts.services import tenants as accounts_port

        from . import services

        accounts_port.running_jobs_stop.provide(services.tenant_running_jobs_stop)
        accounts_port.schedule_soon.provide(services.schedule_soon)
