"""Tenants: creation and sign-up, quotas, suspension.

Suspending stops running jobs and reinstating asks for a scheduling pass: both are the
scheduler's, above accounts, so they are reached through ports the scheduler provides at
start-up (``scheduler.apps``). The budget beat moved to the admission app.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction

from gpushare.ports import Port

from ..models import Membership, Role, RunningJobsPolicy, Tenant, TenantQuota
from ..selectors import limits_for
from ..tenancy import tenant_scope
from .common import AccountsError, audit_record

running_jobs_stop = Port(
    "accounts.running_jobs_stop",
    "running_jobs_stop(*, tenant, reason) -> int: ask the agents to stop the tenant's running jobs",
)
schedule_soon = Port("accounts.schedule_soon", "schedule_soon(): a scheduling pass after commit")


@transaction.atomic
def tenant_create(*, slug: str, name: str = "", owner_email: str, owner_password: str | None) -> Tenant:
    """Create a tenant and its owner (or make an existing user its owner)."""
    user_model = get_user_model()
    tenant = Tenant.objects.create(slug=slug, name=name or slug, billing_email=owner_email)
    user, created = user_model.objects.get_or_create(username=owner_email, defaults={"email": owner_email})
    if created or owner_password:
        if owner_password:
            user.set_password(owner_password)
        else:
            user.set_unusable_password()
        user.save()
    with tenant_scope(tenant):
        Membership.objects.create(tenant=tenant, user=user, role=Role.OWNER)
    audit_record(actor=user, tenant=tenant, action="tenant.create", target=slug, after={"owner": owner_email})
    return tenant


@transaction.atomic
def signup_create(*, organisation: str, slug: str, email: str, password: str):
    """Self-service sign-up: a NEW user and a new tenant it owns. Never touches an existing
    account (an email or slug taken meanwhile raises IntegrityError and nothing is written)."""
    user = get_user_model().objects.create_user(username=email, email=email, password=password)
    tenant = Tenant.objects.create(slug=slug, name=organisation or slug, billing_email=email)
    with tenant_scope(tenant):
        Membership.objects.create(tenant=tenant, user=user, role=Role.OWNER)
    audit_record(
        actor=user, tenant=tenant, action="tenant.create", target=slug, after={"owner": email, "via": "signup"}
    )
    return tenant, user


QUOTA_FIELDS = (
    "max_dedicated_gpus",
    "max_shared_milli",
    "max_gpus_per_job",
    "max_open_jobs",
    "max_queued_jobs",
    "max_endpoints",
    "max_replicas_per_endpoint",
    "max_log_bytes_per_job",
    "api_requests_per_minute",
    "max_disk_mb_per_job",
    "gpu_hours_per_month",
    "monthly_spend_limit",
    "budget_alert_percent",
    "on_budget_exhausted",
    "on_suspended",
)


def _quota_snapshot(quota: TenantQuota) -> dict:
    out = {name: getattr(quota, name) for name in QUOTA_FIELDS}
    out = {k: (str(v) if v is not None and not isinstance(v, int | str) else v) for k, v in out.items()}
    out["plan"] = quota.plan.name if quota.plan_id else None
    return out


@transaction.atomic
def quota_set(*, tenant: Tenant, actor, plan=..., **limits) -> TenantQuota:
    """The operator sets a tenant's plan and/or limit overrides (None: back to the plan's value)."""
    unknown = sorted(set(limits) - set(QUOTA_FIELDS))
    if unknown:
        raise AccountsError(f"unknown quota field(s) {', '.join(unknown)}; known: {', '.join(QUOTA_FIELDS)}")
    for name in ("on_budget_exhausted", "on_suspended"):
        if limits.get(name) not in (None, "", *RunningJobsPolicy.values):
            raise AccountsError(f"{name} is one of {', '.join(RunningJobsPolicy.values)}")
    if limits.get("budget_alert_percent") is not None and not 1 <= limits["budget_alert_percent"] <= 100:
        raise AccountsError("budget_alert_percent is between 1 and 100")
    Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
    with tenant_scope(tenant):
        quota, _ = TenantQuota.objects.select_for_update().get_or_create(tenant=tenant)
        before = _quota_snapshot(quota)
        for name, value in limits.items():
            setattr(quota, name, value if value is not None else ("" if name.startswith("on_") else None))
        if plan is not ...:
            quota.plan = plan
        try:
            quota.full_clean(exclude=["tenant"])
        except ValidationError as exc:
            problems = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            raise AccountsError(f"invalid quota: {problems}") from exc
        quota.save()
    audit_record(
        actor=actor, tenant=tenant, action="quota.set", target=tenant.slug, before=before, after=_quota_snapshot(quota)
    )
    return quota


@transaction.atomic
def tenant_suspend(*, tenant: Tenant, actor, reason: str) -> Tenant:
    """Suspend: no new jobs, queued jobs wait, running jobs stop or finish per ``on_suspended``.
    The tenant can still sign in, read its data and pay."""
    if not reason.strip():
        raise AccountsError("a suspension needs a reason")
    with tenant_scope(tenant):
        tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        if tenant.state == Tenant.State.SUSPENDED:
            return tenant
        tenant.state = Tenant.State.SUSPENDED
        tenant.save(update_fields=["state"])
        policy = limits_for(tenant).on_suspended
        stopped = 0
        if policy == RunningJobsPolicy.STOP:
            stopped = running_jobs_stop(tenant=tenant, reason=f"tenant suspended: {reason}")
    audit_record(
        actor=actor,
        tenant=tenant,
        action="tenant.suspend",
        target=tenant.slug,
        before={"state": Tenant.State.ACTIVE},
        after={"state": Tenant.State.SUSPENDED, "reason": reason, "running_jobs": policy, "stopped": stopped},
    )
    return tenant


@transaction.atomic
def tenant_reinstate(*, tenant: Tenant, actor, reason: str = "") -> Tenant:
    with tenant_scope(tenant):
        tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        if tenant.state == Tenant.State.ACTIVE:
            return tenant
        before = tenant.state
        tenant.state = Tenant.State.ACTIVE
        tenant.save(update_fields=["state"])
    audit_record(
        actor=actor,
        tenant=tenant,
        action="tenant.reinstate",
        target=tenant.slug,
        before={"state": before},
        after={"state": Tenant.State.ACTIVE, "reason": reason},
    )
    schedule_soon()
    return tenant
