from django import template

register = template.Library()


@register.filter
def gpu_hours(milli_gpu_ms: int) -> str:
    """milli-GPU-milliseconds → GPU-hours, 3 decimals."""
    return f"{milli_gpu_ms / 1000 / 3_600_000:,.3f}"
