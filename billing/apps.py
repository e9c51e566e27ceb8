from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Prices, usage and invoices"

    def ready(self) -> None:
        """Provide what the scheduler (below) asks of billing: the model prices of the placement score."""
        from scheduler import pricing

        from . import selectors

        pricing.model_prices.provide(selectors.model_prices)
