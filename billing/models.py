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

    # Every index is written once per window at ingest, so they are few:
    # tenant and job are indexed by (tenant, start_ms) and (job, start_ms),
    # price is never looked up.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False)
    job = models.ForeignKey("scheduler.Job", on_delete=models.CASCADE, related_name="usage_windows", db_index=False)
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
    priority_class = models.CharField(max_length=50, blank=True)
    price = models.ForeignKey(Price, on_delete=models.PROTECT, null=True, related_name="+", db_index=False)
    amount = models.DecimalField(max_digits=20, decimal_places=10)
    received_at = models.DateTimeField(auto_now_add=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["job_id", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["job", "node", "attempt", "seq"], name="usage_window_unique_seq"),
            models.CheckConstraint(condition=models.Q(end_ms__gt=models.F("start_ms")), name="usage_window_positive"),
        ]
        indexes = [
            models.Index(fields=["tenant", "start_ms"]),
            # Ingest's replay and overlap checks read a job's windows near the batch's start.
            models.Index(fields=["job", "start_ms"], name="usage_window_job_start"),
        ]


class TenantDiscount(models.Model):
    """A per-tenant discount in percent, in force from a date (until another, or forever).

    Like prices, a discount never rewrites past usage: each instant is rated
    with the discount in force at that instant.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    percent = models.DecimalField(max_digits=5, decimal_places=2)
    effective_from = models.DateTimeField()
    effective_until = models.DateTimeField(null=True, blank=True)
    note = models.CharField(max_length=200, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["tenant_id", "effective_from"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(percent__gte=0, percent__lte=100), name="tenant_discount_percent_range"
            ),
            models.CheckConstraint(
                condition=models.Q(effective_until__isnull=True)
                | models.Q(effective_until__gt=models.F("effective_from")),
                name="tenant_discount_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} -{self.percent}% from {self.effective_from:%Y-%m-%d}"


class Invoice(models.Model):
    """A tenant's bill for one calendar month (UTC)."""

    class State(models.TextChoices):
        DRAFT = "draft"  # closed from usage, not yet sent to Stripe
        OPEN = "open"  # finalized at Stripe, awaiting payment
        PAID = "paid"
        PAYMENT_FAILED = "payment_failed"
        VOID = "void"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invoices")
    month = models.DateField(help_text="First day of the month billed (UTC).")
    state = models.CharField(max_length=16, choices=State.choices, default=State.DRAFT, db_index=True)
    currency = models.CharField(max_length=3, default="usd")
    total = models.DecimalField(max_digits=14, decimal_places=2, default=0)
    stripe_customer_id = models.CharField(max_length=64, blank=True)
    stripe_invoice_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    first_failed_at = models.DateTimeField(null=True, blank=True)
    failure_count = models.PositiveIntegerField(default=0)
    failure_message = models.CharField(max_length=300, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-month", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month"], name="invoice_unique_tenant_month"),
            models.CheckConstraint(condition=models.Q(total__gte=0), name="invoice_total_non_negative"),
        ]

    def __str__(self) -> str:
        return f"invoice {self.pk} {self.tenant} {self.month:%Y-%m} ({self.state})"


# The invoice state machine, in one place. services.invoice_transition enforces it.
INVOICE_TRANSITIONS: dict[str, frozenset[str]] = {
    Invoice.State.DRAFT: frozenset({Invoice.State.OPEN, Invoice.State.PAID, Invoice.State.VOID}),
    Invoice.State.OPEN: frozenset({Invoice.State.PAID, Invoice.State.PAYMENT_FAILED, Invoice.State.VOID}),
    Invoice.State.PAYMENT_FAILED: frozenset({Invoice.State.PAID, Invoice.State.PAYMENT_FAILED, Invoice.State.VOID}),
    Invoice.State.PAID: frozenset(),
    Invoice.State.VOID: frozenset(),
}


class InvoiceLine(models.Model):
    """One line: a GPU model × mode × priority class × rate, rounded once to cents."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    gpu_model = models.CharField(max_length=64)
    mode = models.CharField(max_length=16)
    priority_class = models.CharField(max_length=50)
    # The effective rate per GPU-hour: price × class multiplier × (1 - discount).
    rate_per_gpu_hour = models.DecimalField(max_digits=20, decimal_places=10)
    gpu_ms = models.BigIntegerField()
    sm_util_ms = models.BigIntegerField(default=0)
    memory_mb_ms = models.BigIntegerField(default=0)
    energy_mj = models.BigIntegerField(default=0)
    exact_amount = models.DecimalField(max_digits=24, decimal_places=10)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    stripe_item_id = models.CharField(max_length=64, blank=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["gpu_model", "mode", "priority_class", "rate_per_gpu_hour"]


class ChargeBatch(models.Model):
    """The charges one ingest transaction wrote for one tenant and month: the unit an invoice takes.

    Closing a month marks batches, not charges: a few rows per tenant instead
    of one per window (set per charge, ``invoice_id`` cost a row update and
    index entries per window at every close). A batch is committed with its
    charges, so a close either sees all of a batch or none of it; a batch
    committed after the close goes on the tenant's next invoice.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    month = models.DateField()
    # Set when the batch is put on an invoice (cleared when that invoice is voided).
    invoice = models.ForeignKey(Invoice, on_delete=models.SET_NULL, null=True, blank=True, related_name="batches")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(
                fields=["month", "tenant"], condition=models.Q(invoice__isnull=True), name="charge_batch_pending"
            )
        ]


class Charge(models.Model):
    """A rated piece of a usage window: the part of it under one price, discount and month.

    A window that straddles a price change, a discount change or a month
    boundary is split into one charge per piece; metered figures are split in
    proportion to time, so the pieces add up exactly to the window.
    """

    # Ingest writes every index and checks every foreign key once per charge,
    # so both are few. tenant, job and price are copies of the window's, which
    # has the database constraints: here they are plain columns to the
    # database (the ORM still cascades and protects on delete). tenant is
    # indexed by (tenant, month); price is never looked up.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+", db_index=False, db_constraint=False)
    window = models.ForeignKey(UsageWindow, on_delete=models.CASCADE, related_name="charges")
    job = models.ForeignKey("scheduler.Job", on_delete=models.CASCADE, related_name="+", db_constraint=False)
    month = models.DateField()
    start_ms = models.BigIntegerField()
    end_ms = models.BigIntegerField()
    gpu_model = models.CharField(max_length=64)
    mode = models.CharField(max_length=16)
    priority_class = models.CharField(max_length=50)
    price = models.ForeignKey(
        Price, on_delete=models.PROTECT, null=True, related_name="+", db_index=False, db_constraint=False
    )
    rate_per_gpu_hour = models.DecimalField(max_digits=20, decimal_places=10)
    gpu_ms = models.BigIntegerField()
    sm_util_ms = models.BigIntegerField(default=0)
    memory_mb_ms = models.BigIntegerField(default=0)
    energy_mj = models.BigIntegerField(default=0)
    amount = models.DecimalField(max_digits=20, decimal_places=10)
    # The batch decides the invoice. Null only for a charge written outside
    # ingest (a fixture, a manual correction): the next close adopts it into a
    # batch of its own before invoicing.
    batch = models.ForeignKey(ChargeBatch, on_delete=models.RESTRICT, null=True, blank=True, related_name="charges")

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["start_ms", "id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(end_ms__gt=models.F("start_ms")), name="charge_positive"),
        ]
        indexes = [
            models.Index(fields=["tenant", "month"]),
            models.Index(fields=["month"], condition=models.Q(batch__isnull=True), name="charge_unbatched"),
        ]

    @property
    def invoice(self) -> Invoice | None:
        """The invoice this charge is on (through its batch), or None while uninvoiced."""
        return self.batch.invoice if self.batch_id else None


class StripeEvent(models.Model):
    """A webhook event we have processed: a replay of the same id is ignored."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    received_at = models.DateTimeField(auto_now_add=True)
    payload = models.JSONField()

    class Meta:
        ordering = ["-received_at"]


class BillingPolicy(models.Model):
    """Operator settings for collection (one row; see ``billing_policy()``)."""

    payment_grace_days = models.PositiveIntegerField(
        default=7, help_text="Days after the first failed payment before the tenant is suspended."
    )
    suspend_after_failures = models.PositiveIntegerField(
        default=2, help_text="Failed payments on one invoice (within or after the grace) that allow suspension."
    )

    class Meta:
        verbose_name_plural = "billing policy"

    def __str__(self) -> str:
        return f"grace {self.payment_grace_days} d, suspend after {self.suspend_after_failures} failures"
