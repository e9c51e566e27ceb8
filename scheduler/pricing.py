"""What the placement core's price term asks of billing (above the scheduler), provided at start-up.

The scheduler never imports billing (``.importlinter``): billing's ``AppConfig.ready`` plugs
:func:`billing.selectors.model_prices` into this port, and a call before that raises
``ImproperlyConfigured`` (gpushare/ports.py) instead of placing without prices.
"""

from __future__ import annotations

from gpushare.ports import Port

model_prices = Port(
    "scheduler.model_prices",
    "model_prices(*, at) -> dict[str, float]: GPU model -> price of a dedicated GPU-hour in force at `at`; "
    "models without a price are absent",
)
