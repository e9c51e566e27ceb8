"""Tenancy fails closed: tenant tasks enter their tenant's scope, billing's selectors take the tenant,
and the invoice pages go through the portal's tenant decorator."""

from __future__ import annotations

import inspect
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import QuerySet
from django.test import Client
from django.utils import timezone
from django_scopes import ScopeError, scope, scopes_disabled

from accounts.tenant_tasks import TenantScopeMissing, TenantTask
from billing import selectors as billing_selectors
from billing.models import Invoice
from gpushare.celery import app
from scheduler.models import Job
from tests.api.helpers import job_make
from tests.factories import UserFactory, member_add

pytestmark = pytest.mark.django_db

# Tasks that act for the platform or for a node, not for one tenant: why each is not a TenantTask.
NOT_TENANT_TASKS = {
    "scheduler.pass": "places every tenant's jobs",
    "scheduler.launches_resend": "platform sweep",
    "agents.": "a node's reports, authenticated as the node; attributed by the platform to each job's tenant",
    "billing.close_month": "closes every tenant's month",
    "billing.dunning_check": "platform sweep",
    "webhooks.deliveries_due": "platform sweep",
    "endpoints.autoscale": "platform sweep",
    "endpoints.minutes_prune": "platform sweep",
    "admission.budgets_enforce": "every budgeted tenant, one transaction each",
    "console.": "the operator's what-if runs",
}


def _our_tasks():
    app.loader.import_default_modules()  # every installed app's tasks.py (autodiscovery)
    prefixes = ("scheduler.", "agents.", "billing.", "webhooks.", "endpoints.", "admission.", "console.", "accounts.")
    return {name: task for name, task in app.tasks.items() if name.startswith(prefixes)}


def test_every_task_acts_for_a_tenant_in_its_scope_or_says_why_not():
    unexplained = []
    for name, task in sorted(_our_tasks().items()):
        if isinstance(task, TenantTask):
            continue
        if not any(name == k or (k.endswith(".") and name.startswith(k)) for k in NOT_TENANT_TASKS):
            unexplained.append(name)
    assert unexplained == [], f"tasks that neither enter a tenant scope nor say why: {unexplained}"
    assert isinstance(app.tasks["billing.invoice_send"], TenantTask)
    assert isinstance(app.tasks["webhooks.deliver"], TenantTask)
    assert isinstance(app.tasks["endpoints.autoscale_one"], TenantTask)


def test_a_tenant_task_called_without_its_tenant_raises():
    for name, task in _our_tasks().items():
        if isinstance(task, TenantTask):
            with pytest.raises(TenantScopeMissing, match=name):
                task()


@app.task(name="tests.jobs_seen", base=TenantTask, tenant_from="tenant_id")
def jobs_seen(*, tenant_id):
    return sorted(Job.objects.values_list("pk", flat=True))


@app.task(name="tests.jobs_seen_unscoped")
def jobs_seen_unscoped():
    return list(Job.objects.values_list("pk", flat=True))


def test_a_tenant_task_sees_only_its_tenants_rows_and_a_plain_one_raises(rules, tenant, other_tenant):
    mine, theirs = job_make(tenant), job_make(other_tenant)
    assert jobs_seen(tenant_id=tenant.pk) == [mine.pk]
    assert jobs_seen(tenant_id=other_tenant.pk) == [theirs.pk]
    with pytest.raises(TenantScopeMissing):
        jobs_seen()
    with pytest.raises(ScopeError):  # a task that forgot its scope fails closed
        jobs_seen_unscoped()


def test_a_tenant_task_for_a_row_scopes_to_the_rows_tenant(rules, tenant, other_tenant):
    invoice = _invoice(tenant)
    seen = {}

    @app.task(name="tests.invoice_scope", base=TenantTask, tenant_from=("billing.Invoice", "invoice_id"))
    def invoice_scope(invoice_id):
        seen["invoices"] = list(Invoice.objects.values_list("pk", flat=True))

    _invoice(other_tenant)
    invoice_scope(invoice_id=invoice.pk)
    assert seen["invoices"] == [invoice.pk]
    seen.clear()
    invoice_scope(invoice.pk)  # positional, as its signature names it
    assert seen["invoices"] == [invoice.pk]
    invoice_scope(invoice_id=10**9)  # gone: an empty scope, nothing seen, no error (safe to run twice)
    assert seen["invoices"] == []


def _invoice(tenant) -> Invoice:
    with scopes_disabled():
        return Invoice.objects.create(tenant=tenant, month=(timezone.now() - timedelta(days=40)).date().replace(day=1))


def _arguments(func, tenant) -> dict:
    now = timezone.now()
    known = {
        "tenant": tenant,
        "at": now,
        "start": now - timedelta(days=30),
        "end": now,
        "group_by": "day",
        "invoice_id": 1,
    }
    return {name: known[name] for name in inspect.signature(func).parameters}


def test_every_billing_selector_that_takes_a_tenant_raises_outside_a_scope(rules, tenant, other_tenant):
    """Walk billing.selectors: each function taking ``tenant`` reads through scoped managers, so a caller
    that forgot the scope gets ScopeError, and inside another tenant's scope it sees nothing of this one."""
    _invoice(tenant)
    walked = []
    for name, func in inspect.getmembers(billing_selectors, inspect.isfunction):
        if func.__module__ != billing_selectors.__name__ or "tenant" not in inspect.signature(func).parameters:
            continue
        walked.append(name)
        kwargs = _arguments(func, tenant)

        def call(f=func, kw=kwargs):
            result = f(**kw)
            return list(result) if isinstance(result, QuerySet) else result

        with pytest.raises(ScopeError):
            call()
        with scope(tenant=tenant):
            call()
    assert set(walked) >= {
        "invoice_with_lines",
        "invoices_for_tenant",
        "spend_summary",
        "tenant_month_spend",
        "usage_summary",
    }


def test_the_invoice_page_goes_through_the_portal_tenant_decorator(rules, tenant, other_tenant):
    invoice = _invoice(tenant)
    owner, outsider, viewer = member_add(tenant, role="owner"), member_add(other_tenant, role="owner"), None
    viewer = member_add(tenant, role="viewer")
    client = Client()
    assert client.get(f"/billing/invoices/{invoice.pk}/").status_code == 302  # the portal's login redirect
    client.force_login(owner)
    page = client.get(f"/billing/invoices/{invoice.pk}/")
    assert page.status_code == 200 and page.context["request"].portal.tenant == tenant
    assert client.get(f"/billing/invoices/{invoice.pk}/jobs.csv").status_code == 200
    for user in (outsider, viewer):
        client.force_login(user)
        assert client.get(f"/billing/invoices/{invoice.pk}/").status_code == 404
        assert client.get(f"/billing/invoices/{invoice.pk}/jobs.csv").status_code == 404
    # The operator prints any tenant's invoice from the admin.
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    assert client.get(f"/admin/billing/invoice/{invoice.pk}/print/").status_code == 200
    client.force_login(owner)
    assert client.get(f"/admin/billing/invoice/{invoice.pk}/print/").status_code == 302  # admin login


def test_money_is_decimal_in_the_spend_summary(rules, tenant):
    with scope(tenant=tenant):
        summary = billing_selectors.spend_summary(tenant=tenant, at=timezone.now())
    assert isinstance(summary.spent, Decimal)
