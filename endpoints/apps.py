from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    verbose_name = "Inference endpoints"
