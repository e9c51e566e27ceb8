"""Writes for tenants, members and API tokens. Each service is one transaction."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from . import quotas
from .models import ApiToken, AuditLog, Invitation, Membership, Role, RunningJobsPolicy, Tenant, TenantQuota
from .permissions import RANK, denied_message, may_act_on, role_allows, role_for

TOKEN_PREFIX = "gps_"
ALL_SCOPES = ("jobs:read", "jobs:write", "usage:read", "billing:read")
DEFAULT_SCOPES = ("jobs:read", "jobs:write", "usage:read")


INVITE_VALID_DAYS = 7


class AccountsError(Exception):
    """A request the rules refuse; ``code`` is machine-readable (forbidden, invalid, conflict, not_found)."""

    def __init__(self, message: str, *, code: str = "invalid"):
        super().__init__(message)
        self.code = code


def _require(*, actor, tenant: Tenant, action: str) -> str:
    """The actor's role in ``tenant`` if it allows ``action`` (the platform's staff may do anything)."""
    if getattr(actor, "is_staff", False):
        return Role.OWNER
    role = role_for(user=actor, tenant=tenant)
    if not role_allows(role, action):
        raise AccountsError(denied_message(action), code="forbidden")
    return role


def token_hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def audit_record(*, actor, tenant, action: str, target: str = "", before=None, after=None) -> AuditLog:
    return AuditLog.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        tenant=tenant,
        action=action,
        target=target,
        before=before,
        after=after,
    )


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
    with scopes_disabled():
        Membership.objects.create(tenant=tenant, user=user, role=Role.OWNER)
    audit_record(actor=user, tenant=tenant, action="tenant.create", target=slug, after={"owner": owner_email})
    return tenant


@transaction.atomic
def signup_create(*, organisation: str, slug: str, email: str, password: str):
    """Self-service sign-up: a NEW user and a new tenant it owns. Never touches an existing
    account (an email or slug taken meanwhile raises IntegrityError and nothing is written)."""
    user = get_user_model().objects.create_user(username=email, email=email, password=password)
    tenant = Tenant.objects.create(slug=slug, name=organisation or slug, billing_email=email)
    with scopes_disabled():
        Membership.objects.create(tenant=tenant, user=user, role=Role.OWNER)
    audit_record(
        actor=user, tenant=tenant, action="tenant.create", target=slug, after={"owner": email, "via": "signup"}
    )
    return tenant, user


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    plaintext: str


@transaction.atomic
def token_create(
    *,
    tenant: Tenant,
    user,
    name: str,
    scopes: tuple[str, ...] | list[str] = DEFAULT_SCOPES,
    expires_days: int | None = None,
    actor=None,
) -> IssuedToken:
    """Issue a token; the plaintext is returned once and never stored."""
    unknown = sorted(set(scopes) - set(ALL_SCOPES))
    if unknown:
        raise ValueError(f"unknown scope(s) {', '.join(unknown)}; allowed: {', '.join(ALL_SCOPES)}")
    with scopes_disabled():
        if not Membership.objects.filter(tenant=tenant, user=user).exists():
            raise ValueError(f"{user} is not a member of tenant {tenant.slug}")
        prefix = secrets.token_hex(4)
        plaintext = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days else None
        token = ApiToken.objects.create(
            tenant=tenant,
            user=user,
            name=name,
            prefix=f"{TOKEN_PREFIX}{prefix}",
            token_hash=token_hash(plaintext),
            scopes=sorted(scopes),
            expires_at=expires_at,
        )
    audit_record(
        actor=actor or user,
        tenant=tenant,
        action="token.create",
        target=token.prefix,
        after={"name": name, "scopes": sorted(scopes), "expires_at": expires_at.isoformat() if expires_at else None},
    )
    return IssuedToken(token=token, plaintext=plaintext)


@transaction.atomic
def token_revoke(*, token: ApiToken, actor) -> ApiToken:
    """Revoke a token (its owner, or an admin/owner of the tenant; actor=None: the platform)."""
    if actor is not None and not getattr(actor, "is_staff", False):
        role = role_for(user=actor, tenant=token.tenant)
        if not may_act_on(role, "tokens.revoke", owner_id=token.user_id, user_id=actor.pk):
            raise AccountsError(
                "only the token's owner or an admin/owner of the tenant may revoke it", code="forbidden"
            )
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        audit_record(actor=actor, tenant=token.tenant, action="token.revoke", target=token.prefix)
    return token


# --- members and invitations ---------------------------------------------------------


def _owner_guard(*, actor_role: str, role: str) -> None:
    if RANK.get(role, 0) > RANK[actor_role]:
        raise AccountsError(f"a {actor_role} cannot grant or change the {role} role", code="forbidden")


@dataclass(frozen=True)
class IssuedInvitation:
    invitation: Invitation
    plaintext: str


@transaction.atomic
def member_invite(
    *, tenant: Tenant, actor, email: str, role: str = Role.MEMBER, accept_url: str = ""
) -> IssuedInvitation:
    """Invite ``email`` to ``tenant`` with ``role``; sends a one-time link (``accept_url`` + the secret)."""
    from django.core.mail import send_mail

    actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
    if role not in Role.values:
        raise AccountsError(f"unknown role {role!r}; allowed: {', '.join(Role.values)}")
    _owner_guard(actor_role=actor_role, role=role)
    email = get_user_model().objects.normalize_email(email).strip().lower()
    with scopes_disabled():
        if Membership.objects.filter(tenant=tenant, user__username__iexact=email).exists():
            raise AccountsError(f"{email} is already a member of {tenant.slug}", code="conflict")
        plaintext = secrets.token_urlsafe(32)
        invitation = Invitation.objects.create(
            tenant=tenant,
            email=email,
            role=role,
            token_hash=token_hash(plaintext),
            invited_by=actor if getattr(actor, "pk", None) else None,
            expires_at=timezone.now() + timedelta(days=INVITE_VALID_DAYS),
        )
    audit_record(actor=actor, tenant=tenant, action="member.invite", target=email, after={"role": role})
    link = invite_link(plaintext, accept_url=accept_url)
    transaction.on_commit(
        lambda: send_mail(
            f"You are invited to {tenant.name} on gpushare",
            f"{getattr(actor, 'username', 'Someone')} invited you to join {tenant.name} as {role}.\n\n"
            f"Accept within {INVITE_VALID_DAYS} days (the link works once):\n{link}\n",
            None,
            [email],
        )
    )
    return IssuedInvitation(invitation=invitation, plaintext=plaintext)


def invite_link(plaintext: str, *, accept_url: str = "") -> str:
    """The one-time link: ``accept_url`` (e.g. ``request.build_absolute_uri("/accounts/invite/")``)
    + the secret, or settings.SITE_URL + the invite page's path."""
    from django.conf import settings
    from django.urls import reverse

    if accept_url:
        return f"{accept_url.rstrip('/')}/{plaintext}/"
    return f"{getattr(settings, 'SITE_URL', '').rstrip('/')}{reverse('invite_accept', kwargs={'secret': plaintext})}"


def invitation_find(plaintext: str) -> Invitation | None:
    """The pending, unexpired invitation for this secret (None otherwise)."""
    with scopes_disabled():
        return (
            Invitation.objects.select_related("tenant")
            .filter(token_hash=token_hash(plaintext), accepted_at__isnull=True, expires_at__gt=timezone.now())
            .first()
        )


@transaction.atomic
def invite_accept(*, plaintext: str, user=None, password: str | None = None) -> Membership:
    """Use an invitation once: ``user`` (logged in) or a new user named by the invited email joins."""
    with scopes_disabled():
        invitation = (
            Invitation.objects.select_for_update()
            .select_related("tenant")
            .filter(token_hash=token_hash(plaintext))
            .first()
        )
        if invitation is None or invitation.accepted_at is not None or invitation.expires_at <= timezone.now():
            raise AccountsError("this invitation link is unknown, used or expired", code="not_found")
        if user is None:
            user_model = get_user_model()
            if user_model.objects.filter(username__iexact=invitation.email).exists():
                raise AccountsError(
                    "an account with this email exists: log in, then open the link again", code="conflict"
                )
            if not password:
                raise AccountsError("choose a password")
            user = user_model(username=invitation.email, email=invitation.email)
            user.set_password(password)
            user.save()
        membership, created = Membership.objects.get_or_create(
            tenant=invitation.tenant, user=user, defaults={"role": invitation.role}
        )
        if not created:
            raise AccountsError(f"you are already a member of {invitation.tenant.slug}", code="conflict")
        invitation.accepted_at = timezone.now()
        invitation.accepted_by = user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(
        actor=user,
        tenant=invitation.tenant,
        action="member.join",
        target=user.username,
        after={"role": membership.role},
    )
    return membership


def _owners_left(tenant: Tenant, *, excluding: Membership) -> int:
    return Membership.objects.filter(tenant=tenant, role=Role.OWNER).exclude(pk=excluding.pk).count()


@transaction.atomic
def member_role_change(*, membership: Membership, actor, role: str) -> Membership:
    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=membership.tenant_id)
    actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
    if role not in Role.values:
        raise AccountsError(f"unknown role {role!r}; allowed: {', '.join(Role.values)}")
    with scopes_disabled():
        membership = Membership.objects.select_related("user").get(pk=membership.pk)
        _owner_guard(actor_role=actor_role, role=role)
        _owner_guard(actor_role=actor_role, role=membership.role)
        if membership.role == Role.OWNER and role != Role.OWNER and not _owners_left(tenant, excluding=membership):
            raise AccountsError("a tenant keeps at least one owner: make someone else owner first", code="conflict")
        before = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.role_change",
        target=membership.user.username,
        before={"role": before},
        after={"role": role},
    )
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, actor) -> None:
    """Remove a member (or leave, when actor is the member); their tokens stop working with the membership."""
    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=membership.tenant_id)
    with scopes_disabled():
        membership = Membership.objects.select_related("user").get(pk=membership.pk)
        if actor is None or actor.pk != membership.user_id:
            actor_role = _require(actor=actor, tenant=tenant, action="members.manage")
            _owner_guard(actor_role=actor_role, role=membership.role)
        if membership.role == Role.OWNER and not _owners_left(tenant, excluding=membership):
            raise AccountsError("the last owner cannot be removed: make someone else owner first", code="conflict")
        ApiToken.objects.filter(tenant=tenant, user=membership.user, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        membership.delete()
    audit_record(
        actor=actor,
        tenant=tenant,
        action="member.remove",
        target=membership.user.username,
        before={"role": membership.role},
    )


# --- quotas, suspension ------------------------------------------------------------------

QUOTA_FIELDS = (
    "max_dedicated_gpus",
    "max_shared_milli",
    "max_gpus_per_job",
    "max_open_jobs",
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
    with scopes_disabled():
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


def _running_jobs_stop(*, tenant: Tenant, reason: str) -> int:
    from scheduler.models import ACTIVE_STATES, Job
    from scheduler.services import job_cancel

    stopped = 0
    for job in Job.objects.filter(tenant=tenant, state__in=ACTIVE_STATES).exclude(stop_requested="cancel"):
        job_cancel(job=job, actor=None, reason=reason)
        stopped += 1
    return stopped


@transaction.atomic
def tenant_suspend(*, tenant: Tenant, actor, reason: str) -> Tenant:
    """Suspend: no new jobs, queued jobs wait, running jobs stop or finish per ``on_suspended``.
    The tenant can still sign in, read its data and pay."""
    if not reason.strip():
        raise AccountsError("a suspension needs a reason")
    with scopes_disabled():
        tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
        if tenant.state == Tenant.State.SUSPENDED:
            return tenant
        tenant.state = Tenant.State.SUSPENDED
        tenant.save(update_fields=["state"])
        policy = quotas.limits_for(tenant).on_suspended
        stopped = 0
        if policy == RunningJobsPolicy.STOP:
            stopped = _running_jobs_stop(tenant=tenant, reason=f"tenant suspended: {reason}")
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
    with scopes_disabled():
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
    from scheduler.services import schedule_soon

    schedule_soon()
    return tenant


def budgets_enforce(*, now=None) -> dict:
    """Platform-wide, safe to run twice: alert once a month at the threshold, and stop
    running jobs of tenants whose month budget is exhausted when the setting says stop.
    Only tenants with a GPU-hour or spend limit are looked at; each in its own transaction."""
    with scopes_disabled():
        budgeted = quotas.budgeted_tenants()
        with transaction.atomic():
            quotas.month_usage_advance(list(budgeted), now=now)
        usages = quotas.month_usages(list(budgeted), now=now) if budgeted else {}
        result = {"alerted": 0, "stopped": 0}
        for tenant in Tenant.objects.filter(pk__in=list(budgeted)):
            alerted, stopped = _budget_enforce_one(
                tenant=tenant, usage=usages.get(tenant.pk, quotas.MonthUsage()), now=now
            )
            result["alerted"] += alerted
            result["stopped"] += stopped
    return result


@transaction.atomic
def _budget_enforce_one(*, tenant: Tenant, usage: quotas.MonthUsage, now=None) -> tuple[int, int]:
    from django.core.mail import send_mail

    tenant = Tenant.objects.select_for_update(no_key=True).get(pk=tenant.pk)
    limits = quotas.limits_for(tenant)
    alerted = stopped = 0
    since = quotas.month_start(now)
    if (
        quotas.alert_due(limits, usage)
        and not AuditLog.objects.filter(tenant=tenant, action="budget.alert", created_at__gte=since).exists()
    ):
        status = {"gpu_ms": usage.gpu_ms, "spend": str(usage.spend), "alert_percent": limits.budget_alert_percent}
        audit_record(actor=None, tenant=tenant, action="budget.alert", target=tenant.slug, after=status)
        if tenant.billing_email:
            transaction.on_commit(
                lambda: send_mail(
                    f"gpushare: {tenant.name} reached {limits.budget_alert_percent}% of its monthly budget",
                    f"This month so far: {usage.gpu_ms / quotas.MS_PER_HOUR:.3f} GPU-hours, spend {usage.spend:.2f}.\n"
                    f"Limits: {limits.gpu_hours_per_month or 'none'} GPU-hours, "
                    f"{limits.monthly_spend_limit or 'no'} spend limit.\n",
                    None,
                    [tenant.billing_email],
                )
            )
        alerted = 1
    refusal = quotas.budget_refusal(limits, usage)
    if refusal is not None and limits.on_budget_exhausted == RunningJobsPolicy.STOP:
        stopped = _running_jobs_stop(tenant=tenant, reason=f"stopped: {refusal.message.split(';')[0]}")
        if stopped:
            audit_record(
                actor=None, tenant=tenant, action="budget.stop_jobs", target=tenant.slug, after={"stopped": stopped}
            )
    return alerted, stopped
