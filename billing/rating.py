"""Pure rating: usage → money. No Django.

A price is per GPU-hour; usage is GPU-milliseconds (already × the fraction
for a shared slice). Amounts are kept exact to 10 decimal places per window;
invoices round once per line (see docs/billing.md).
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

MS_PER_HOUR = 3_600_000
EXACT = Decimal("0.0000000001")


def window_amount(*, gpu_ms: int, per_gpu_hour: Decimal, multiplier: Decimal = Decimal(1)) -> Decimal:
    """Charge for ``gpu_ms`` allocated GPU-milliseconds at ``per_gpu_hour``."""
    if gpu_ms < 0:
        raise ValueError("gpu_ms must not be negative")
    return (Decimal(gpu_ms) * per_gpu_hour * multiplier / MS_PER_HOUR).quantize(EXACT, rounding=ROUND_HALF_EVEN)


def allocated_gpu_ms(*, start_ms: int, end_ms: int, gpu_milli: int) -> int:
    """GPU-milliseconds held over a window: wall time × GPUs (thousandths)."""
    return (end_ms - start_ms) * gpu_milli // 1000
