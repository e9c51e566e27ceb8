from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Tenants and access"

    def ready(self) -> None:
        from . import signals

        signals.connect()
