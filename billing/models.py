"""Prices and metered usage. Money is Decimal; time is integer milliseconds."""

from __future__ import annotations

from django.db import models
from django_scopes import ScopedManager

from accounts.models import Tenant


class Price(models.Model):
    """Price of one GPU-hour of a model in a mode, from a date on.

    Shared slices are charged this price × the slice fraction.
    """

    class Mode(models.TextChoices):
        DEDICATED = "dedicated"
        SHARED = "shared"

    gpu_model = models.CharField(max_length=64)
    mode = models.CharField(max_length=16, choices=Mode.choices)
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    currency = models.CharField(max_length=3, default="usd")
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["gpu_model", "mode", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["gpu_model", "mode", "effective_from"], name="price_unique_effective"),
            models.CheckConstraint(condition=models.Q(per_gpu_hour__gte=0), name="price_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_model} {self.mode} {self.per_gpu_hour}/h from {self.effective_from:%Y-%m-%d}"


class UsageWindow(models.Model):
    """One metering window of one job on one node, rated at ingest.

    ``gpu_ms`` is allocated GPU-milliseconds (wall time × GPUs held, × fraction
    for a slice). ``amount`` is exact (10 decimal places); rounding to cents
    happens once, on the invoice line.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey("scheduler.Job", on_delete=models.CASCADE, related_name="usage_windows")
    node = models.ForeignKey("agents.Node", on_delete=models.PROTECT, related_name="+")
    attempt = models.PositiveIntegerField(default=1)
    seq = models.PositiveIntegerField()
    start_ms = models.BigIntegerField()
    end_ms = models.BigIntegerField()
    gpu_model = models.CharField(max_length=64)
    mode = models.CharField(max_length=16)
    gpu_ms = models.BigIntegerField()
    sm_util_ms = models.BigIntegerField(default=0)
    memory_avg_mb = models.PositiveIntegerField(default=0)
    memory_peak_mb = models.PositiveIntegerField(default=0)
    energy_mj = models.BigIntegerField(default=0)
    price = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, related_name="+")
    amount = models.DecimalField(max_digits=20, decimal_places=10)
    received_at = models.DateTimeField(auto_now_add=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["job_id", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["job", "node", "attempt", "seq"], name="usage_window_unique_seq"),
            models.CheckConstraint(condition=models.Q(end_ms__gt=models.F("start_ms")), name="usage_window_positive"),
        ]
        indexes = [models.Index(fields=["tenant", "start_ms"])]
