"""Read queries for prices and usage."""

from __future__ import annotations

from datetime import UTC, datetime

from .models import Price


def price_at(*, gpu_model: str, mode: str, at_ms: int) -> Price | None:
    """The price in force for ``gpu_model`` in ``mode`` at ``at_ms``."""
    at = datetime.fromtimestamp(at_ms / 1000, tz=UTC)
    return (
        Price.objects.filter(gpu_model=gpu_model, mode=mode, effective_from__lte=at)
        .order_by("-effective_from")
        .first()
    )
