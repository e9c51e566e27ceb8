"""Spend alerts: when a tenant's month spend crosses its alert threshold, email once and flag it."""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import Decimal

from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Tenant

from .. import rating, selectors
from ..models import Charge, SpendAlert

log = logging.getLogger(__name__)


def alert_threshold(*, limit: Decimal | None, percent: int | None, default_percent: int) -> Decimal | None:
    """The spend at which to alert: ``percent`` (or the default) of the monthly limit; None without a limit."""
    if limit is None or limit <= 0:
        return None
    return rating.line_round(limit * Decimal(percent if percent is not None else default_percent) / 100)


@scopes_disabled()
def spend_alert_check(*, tenant: Tenant, at: datetime | None = None) -> SpendAlert | None:
    """Record (and email) an alert if the tenant's spend this month reached its threshold; once per month."""
    from .payments import billing_policy

    at = at or timezone.now()
    summary = selectors.spend_summary(tenant=tenant, at=at)
    threshold = alert_threshold(
        limit=summary.limit, percent=summary.alert_percent, default_percent=billing_policy().default_alert_percent
    )
    if threshold is None or summary.spent < threshold:
        return None
    try:
        with transaction.atomic():
            alert = SpendAlert.objects.create(
                tenant=tenant, month=summary.month, threshold=threshold, spend=summary.spent
            )
    except IntegrityError:
        return None  # already alerted for this threshold this month
    message = (
        f"Tenant {tenant.name} has spent {summary.spent} this month ({summary.month:%Y-%m}), "
        f"reaching the alert threshold of {threshold} (monthly limit {summary.limit}). "
        f"Projected month-end spend: {summary.projected}."
    )
    if tenant.billing_email:
        transaction.on_commit(
            lambda: send_mail(f"gpushare: spend alert for {tenant.slug}", message, None, [tenant.billing_email])
        )
    log.info("spend alert for %s at %s", tenant.slug, summary.spent)
    return alert


@scopes_disabled()
def spend_alerts_check(*, at: datetime | None = None) -> list[SpendAlert]:
    """Check every tenant with charges this month (beat, every minute)."""
    at = at or timezone.now()
    month = rating.month_of(int(at.timestamp() * 1000))
    tenant_ids = Charge.objects.filter(month=month).values_list("tenant_id", flat=True).distinct()
    alerts = []
    for tenant in Tenant.objects.filter(pk__in=list(tenant_ids)):
        if alert := spend_alert_check(tenant=tenant, at=at):
            alerts.append(alert)
    return alerts
