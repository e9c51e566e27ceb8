"""The admin side of the console: every save goes through a service and is audited; non-staff get nothing."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import AuditLog, Plan, Tenant, TenantQuota
from agents.models import Node
from billing.models import Price
from scheduler.models import PriorityClass


def class_form(c: PriorityClass, **overrides) -> dict:
    data = {
        "name": c.name,
        "rank": c.rank,
        "min_runtime_s": c.min_runtime_s,
        "grace_period_s": c.grace_period_s,
        "price_multiplier": c.price_multiplier,
        "default_for_kind": c.default_for_kind,
        "may_preempt": [p.pk for p in c.may_preempt.all()],
    }
    if c.preemptible:
        data["preemptible"] = "on"
    data.update(overrides)
    return data


def test_class_edit_refuses_a_contradiction_with_its_reason(staff_client, rules):
    preemptible = PriorityClass.objects.get(name="preemptible")
    url = reverse("admin:scheduler_priorityclass_change", args=[preemptible.pk])
    response = staff_client.post(url, class_form(preemptible, may_preempt=[preemptible.pk]))
    assert response.status_code == 200
    assert "class preemptible may not preempt itself" in response.content.decode()
    response = staff_client.post(url, class_form(preemptible, default_for_kind="training"))
    assert "one default class per job kind: training has preemptible, standard" in response.content.decode()
    assert not AuditLog.objects.exists()
    assert not preemptible.may_preempt.exists()


def test_class_edit_and_create_are_audited(staff_client, operator, rules):
    standard = PriorityClass.objects.get(name="standard")
    url = reverse("admin:scheduler_priorityclass_change", args=[standard.pk])
    response = staff_client.post(url, class_form(standard, rank=250, may_preempt=[]))
    assert response.status_code == 302, response.content.decode()[:2000]
    standard.refresh_from_db()
    assert standard.rank == 250 and not standard.may_preempt.exists()
    entry = AuditLog.objects.get(action="priority_class.update")
    assert entry.actor == operator
    assert (entry.before["rank"], entry.after["rank"]) == (200, 250)
    assert (entry.before["may_preempt"], entry.after["may_preempt"]) == (["preemptible"], [])

    response = staff_client.post(
        reverse("admin:scheduler_priorityclass_add"),
        {
            "name": "gold",
            "rank": 400,
            "min_runtime_s": 0,
            "grace_period_s": 30,
            "price_multiplier": "2.000",
            "default_for_kind": "",
            "may_preempt": [PriorityClass.objects.get(name="preemptible").pk],
        },
    )
    assert response.status_code == 302
    assert PriorityClass.objects.get(name="gold").may_preempt.get().name == "preemptible"
    created = AuditLog.objects.get(action="priority_class.create")
    assert created.before is None and created.after["may_preempt"] == ["preemptible"]


def test_suspend_and_reinstate_actions_use_the_accounts_services(staff_client, operator, tenant):
    url = reverse("admin:accounts_tenant_changelist")
    response = staff_client.post(url, {"action": "suspend", "_selected_action": [tenant.pk]})
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.SUSPENDED
    entry = AuditLog.objects.get(action="tenant.suspend")
    assert entry.actor == operator and entry.after["reason"].startswith("suspended by operator")
    staff_client.post(url, {"action": "reinstate", "_selected_action": [tenant.pk]})
    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.ACTIVE
    assert AuditLog.objects.filter(action="tenant.reinstate", actor=operator).count() == 1


def test_quota_edit_goes_through_quota_set(staff_client, operator, tenant):
    plan = Plan.objects.create(name="team", max_dedicated_gpus=8)
    url = reverse("admin:accounts_tenant_change", args=[tenant.pk])
    page = staff_client.get(url)
    assert page.status_code == 200
    prefix = page.context["inline_admin_formsets"][0].formset.prefix
    body = {
        "name": tenant.name,
        "billing_email": "",
        f"{prefix}-TOTAL_FORMS": "1",
        f"{prefix}-INITIAL_FORMS": "0",
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1",
        f"{prefix}-0-plan": plan.pk,
        f"{prefix}-0-max_dedicated_gpus": "2",
        f"{prefix}-0-monthly_spend_limit": "500.00",
        f"{prefix}-0-tenant": tenant.pk,
    }
    response = staff_client.post(url, body)
    assert response.status_code == 302, response.context and response.context.get("errors")
    with scopes_disabled():
        quota = TenantQuota.objects.get(tenant=tenant)
    assert (quota.plan, quota.max_dedicated_gpus, quota.monthly_spend_limit) == (plan, 2, Decimal("500.00"))
    entry = AuditLog.objects.get(action="quota.set")
    assert entry.actor == operator and entry.after["max_dedicated_gpus"] == 2 and entry.after["plan"] == "team"


def test_a_new_price_is_added_from_a_date_and_audited_and_old_ones_stay(staff_client, operator, rules):
    old = Price.objects.filter(gpu_model="H100-80GB", mode="dedicated").get()
    response = staff_client.post(
        reverse("admin:billing_price_add"),
        {
            "gpu_model": "H100-80GB",
            "mode": "dedicated",
            "per_gpu_hour": "2.2000",
            "currency": "usd",
            "effective_from_0": "2030-01-01",
            "effective_from_1": "00:00:00",
        },
    )
    assert response.status_code == 302
    assert Price.objects.filter(gpu_model="H100-80GB", mode="dedicated").count() == 2
    old.refresh_from_db()
    assert old.per_gpu_hour == Decimal("2.4900")
    entry = AuditLog.objects.get(action="price.add")
    assert entry.before["per_gpu_hour"] == "2.4900" and entry.after["per_gpu_hour"] == "2.2000"
    change_url = reverse("admin:billing_price_change", args=[old.pk])
    assert 'name="_save"' not in staff_client.get(change_url).content.decode()  # view only
    response = staff_client.post(
        change_url,
        {
            "gpu_model": "H100-80GB",
            "mode": "dedicated",
            "per_gpu_hour": "0",
            "currency": "usd",
            "effective_from_0": "2020-01-01",
            "effective_from_1": "00:00:00",
        },
    )
    assert response.status_code == 403
    old.refresh_from_db()
    assert old.per_gpu_hour == Decimal("2.4900")


def test_node_actions_in_the_admin_are_audited(staff_client, operator, fleet):
    node = fleet[0]
    staff_client.post(reverse("admin:agents_node_changelist"), {"action": "cordon", "_selected_action": [node.pk]})
    node.refresh_from_db()
    assert node.state == Node.State.CORDONED
    assert AuditLog.objects.get(action="node.cordon").actor == operator


@pytest.mark.parametrize(
    "name",
    [
        "admin:scheduler_priorityclass_changelist",
        "admin:accounts_tenant_changelist",
        "admin:accounts_plan_changelist",
        "admin:billing_price_changelist",
        "admin:agents_node_changelist",
        "admin:accounts_auditlog_changelist",
    ],
)
def test_admin_pages_are_staff_only(staff_client, non_staff_client, fleet, rules, name):
    assert staff_client.get(reverse(name)).status_code == 200
    for client in (Client(), non_staff_client):
        response = client.get(reverse(name))
        assert response.status_code == 302 and response["Location"].startswith(reverse("admin:login"))


def test_plan_and_tenant_profile_edits_are_audited(staff_client, operator, tenant):
    response = staff_client.post(
        reverse("admin:accounts_plan_add"),
        {
            "name": "startup",
            "max_dedicated_gpus": "4",
            "monthly_spend_limit": "1000.00",
            "on_budget_exhausted": "stop",
            "on_suspended": "finish",
        },
    )
    assert response.status_code == 302
    plan = Plan.objects.get(name="startup")
    created = AuditLog.objects.get(action="plan.create")
    assert created.actor == operator and created.after["max_dedicated_gpus"] == 4
    response = staff_client.post(
        reverse("admin:accounts_plan_change", args=[plan.pk]),
        {
            "name": "startup",
            "max_dedicated_gpus": "6",
            "monthly_spend_limit": "1000.00",
            "on_budget_exhausted": "stop",
            "on_suspended": "finish",
        },
    )
    assert response.status_code == 302
    updated = AuditLog.objects.get(action="plan.update")
    assert updated.before == {"max_dedicated_gpus": 4} and updated.after == {"max_dedicated_gpus": 6}

    url = reverse("admin:accounts_tenant_change", args=[tenant.pk])
    prefix = staff_client.get(url).context["inline_admin_formsets"][0].formset.prefix
    response = staff_client.post(
        url,
        {
            "name": "Tenant A Ltd",
            "billing_email": "ap@tenant-a.test",
            f"{prefix}-TOTAL_FORMS": "0",
            f"{prefix}-INITIAL_FORMS": "0",
            f"{prefix}-MIN_NUM_FORMS": "0",
            f"{prefix}-MAX_NUM_FORMS": "1",
        },
    )
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.name, tenant.billing_email) == ("Tenant A Ltd", "ap@tenant-a.test")
    entry = AuditLog.objects.get(action="tenant.update")
    assert entry.after == {"name": "Tenant A Ltd", "billing_email": "ap@tenant-a.test"}
    assert entry.before["name"] == "Tenant-A" and entry.tenant == tenant
