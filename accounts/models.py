"""Tenants, the people in them, API tokens and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_scopes import ScopedManager


class Tenant(models.Model):
    class State(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    billing_email = models.EmailField(blank=True)
    stripe_customer_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"
    VIEWER = "viewer"


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="membership_unique_tenant_user")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class ApiToken(models.Model):
    """A long-lived credential for CI; only a hash of the secret is stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tokens")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ScopedManager(tenant="tenant")

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"


class AuditLog(models.Model):
    """Who did what to what, written in the same transaction as the change."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="audit_entries")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200, blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "action", "created_at"])]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.action} {self.target}"


class RunningJobsPolicy(models.TextChoices):
    """What happens to a tenant's running jobs when its budget runs out or it is suspended."""

    STOP = "stop", "stop them"
    FINISH = "finish", "let them finish"


class Limits(models.Model):
    """The limit fields a Plan sets and a TenantQuota may override. Null means: use the plan's
    value (on a TenantQuota), then the ``default`` plan's, then the built-in default
    (``accounts.limits.PLAN_DEFAULTS``; none for the GPU and money limits: no limit)."""

    max_dedicated_gpus = models.PositiveIntegerField(null=True, blank=True, help_text="whole GPUs held at once")
    max_shared_milli = models.PositiveIntegerField(
        null=True, blank=True, help_text="shared slice capacity held at once, in thousandths of a GPU"
    )
    max_gpus_per_job = models.PositiveIntegerField(null=True, blank=True)
    max_open_jobs = models.PositiveIntegerField(
        null=True, blank=True, help_text="jobs submitted and not finished (queued, placed or running)"
    )
    max_queued_jobs = models.PositiveIntegerField(null=True, blank=True, help_text="jobs waiting in the queue")
    max_endpoints = models.PositiveIntegerField(null=True, blank=True, help_text="endpoints not deleted")
    max_replicas_per_endpoint = models.PositiveIntegerField(null=True, blank=True)
    max_log_bytes_per_job = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="log output kept per job; older output is rotated off"
    )
    api_requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="API requests per minute for the whole tenant (all tokens and processes)"
    )
    max_disk_mb_per_job = models.PositiveIntegerField(null=True, blank=True, help_text="scratch disk per job")
    gpu_hours_per_month = models.DecimalField(max_digits=12, decimal_places=3, null=True, blank=True)
    monthly_spend_limit = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True)
    budget_alert_percent = models.PositiveSmallIntegerField(null=True, blank=True)
    on_budget_exhausted = models.CharField(max_length=8, choices=RunningJobsPolicy.choices, blank=True)
    on_suspended = models.CharField(max_length=8, choices=RunningJobsPolicy.choices, blank=True)

    class Meta:
        abstract = True


class Plan(Limits):
    """Default limits for the tenants on it. The plan named ``default`` applies to tenants without one."""

    name = models.SlugField(max_length=50, unique=True)

    def __str__(self) -> str:
        return self.name


class TenantQuota(Limits):
    """The operator's per-tenant settings: a plan, and overrides of its limits."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, null=True, blank=True, related_name="tenants")
    updated_at = models.DateTimeField(auto_now=True)

    objects = ScopedManager(tenant="tenant")

    def __str__(self) -> str:
        return f"quota of {self.tenant}"


class Invitation(models.Model):
    """A one-time invite link sent by email; only a hash of its secret is stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    token_hash = models.CharField(max_length=64, unique=True)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    # Only the invited address may accept, unless an owner said anyone with the link may
    # (e.g. an address that forwards to a colleague's account); recorded in the audit log.
    any_address = models.BooleanField(default=False)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"invite {self.email} to {self.tenant} as {self.role}"


class TenantMonthUsage(models.Model):
    """A tenant's running totals of billing.UsageWindow rows starting in ``month``, for the windows
    with id <= ``through_window_id`` (the rest is summed live; see admission.selectors.month_usages)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    month = models.DateField(help_text="First day of the month (UTC).")
    gpu_ms = models.BigIntegerField(default=0)
    spend = models.DecimalField(max_digits=24, decimal_places=10, default=0)
    through_window_id = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ScopedManager(tenant="tenant")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "month"], name="tenant_month_usage_unique")]

    def __str__(self) -> str:
        return f"{self.tenant} {self.month:%Y-%m}: {self.gpu_ms} GPU-ms, {self.spend}"
