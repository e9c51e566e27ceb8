from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    verbose_name = "Inference endpoints"

    def ready(self) -> None:
        """Tell the scheduler which jobs are replicas (defragmentation moves one only if others serve)."""
        from scheduler import replicas

        from . import selectors

        replicas.endpoint_replicas.provide(selectors.replicas_serving)
