from django.apps import AppConfig


class AdmissionConfig(AppConfig):
    name = "admission"
    verbose_name = "Admission: quotas, holds and limits"

    def ready(self) -> None:
        """Plug the admission rules into the ports the lower apps declared, then check none is left empty."""
        from billing import admission as billing_port
        from endpoints import admission as endpoints_port
        from gpushare import ports
        from scheduler import admission as scheduler_port

        from . import selectors, services

        scheduler_port.job_admit.provide(services.job_admit)
        scheduler_port.tenant_caps.provide(services.tenant_caps_for_scheduling)
        scheduler_port.log_limit.provide(services.log_limit_for)
        endpoints_port.endpoint_admit.provide(services.endpoint_admit)
        billing_port.hold_preview.provide(selectors.hold_preview)
        ports.verify()
