"""Suspension: no new jobs, running jobs stop or finish per the setting, reading still works."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from accounts.models import AuditLog, Role, Tenant
from accounts.services import AccountsError, quota_set, tenant_reinstate, tenant_suspend
from admission.selectors import tenant_caps_for_scheduling as tenant_limits_for_scheduling
from scheduler.models import Job, JobState
from scheduler.services import JobError, JobSpec, job_submit
from tests.accounts.helpers import job_make
from tests.factories import UserFactory, member_add, token_for

pytestmark = pytest.mark.django_db

JOB = {"kind": "training", "gpus": 1, "command": ["true"]}


def test_suspend_stops_running_jobs_and_refuses_submits(rules, tenant, other_tenant, api_client_for):
    operator = UserFactory(is_staff=True)
    user = member_add(tenant, role=Role.MEMBER)
    running, queued = job_make(tenant, user, state=JobState.RUNNING), job_make(tenant, user)
    neighbour = job_make(other_tenant, state=JobState.RUNNING)
    client = api_client_for(tenant, role=Role.MEMBER, user=user)

    tenant_suspend(tenant=tenant, actor=operator, reason="invoice 2026-10 unpaid")

    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.SUSPENDED
    with scopes_disabled():
        running.refresh_from_db()
        queued.refresh_from_db()
        neighbour.refresh_from_db()
    assert running.stop_requested == "cancel" and "tenant suspended: invoice 2026-10 unpaid" in running.stop_reason
    assert queued.state == JobState.QUEUED  # waits; the scheduler holds it (blocked_reason)
    assert neighbour.stop_requested == ""
    assert tenant_limits_for_scheduling()[tenant.pk].blocked_reason == "the tenant is suspended"

    response = client.post("/api/v1/jobs/", JOB, format="json")
    assert response.status_code == 403
    assert "is suspended and cannot submit" in response.json()["error"]["message"]
    with pytest.raises(JobError, match="suspended"):
        job_submit(tenant=tenant, user=user, spec=JobSpec(kind="training", gpu_milli=1000, command=["x"]))
    listed = client.get("/api/v1/jobs/")  # it can still read its data
    assert listed.status_code == 200
    assert {j["id"] for j in listed.json()["results"]} == {running.pk, queued.pk}

    entry = AuditLog.objects.get(tenant=tenant, action="tenant.suspend")
    assert entry.actor == operator
    assert entry.after == {
        "state": "suspended",
        "reason": "invoice 2026-10 unpaid",
        "running_jobs": "stop",
        "stopped": 1,
    }

    tenant_reinstate(tenant=tenant, actor=operator, reason="paid")
    tenant.refresh_from_db()
    assert tenant.state == Tenant.State.ACTIVE
    assert client.post("/api/v1/jobs/", JOB, format="json").status_code == 201
    assert AuditLog.objects.filter(tenant=tenant, action="tenant.reinstate").count() == 1
    assert tenant.pk not in tenant_limits_for_scheduling()


def test_suspend_with_finish_setting_lets_running_jobs_finish(rules, tenant):
    quota_set(tenant=tenant, actor=None, on_suspended="finish")
    running = job_make(tenant, state=JobState.RUNNING)
    tenant_suspend(tenant=tenant, actor=None, reason="operator action")
    with scopes_disabled():
        assert Job.objects.get(pk=running.pk).stop_requested == ""
    assert AuditLog.objects.get(tenant=tenant, action="tenant.suspend").after["running_jobs"] == "finish"


def test_suspend_is_idempotent_and_needs_a_reason(tenant):
    with pytest.raises(AccountsError, match="needs a reason"):
        tenant_suspend(tenant=tenant, actor=None, reason=" ")
    tenant_suspend(tenant=tenant, actor=None, reason="unpaid")
    tenant_suspend(tenant=tenant, actor=None, reason="unpaid again")
    assert AuditLog.objects.filter(tenant=tenant, action="tenant.suspend").count() == 1
    tenant_reinstate(tenant=tenant, actor=None)
    tenant_reinstate(tenant=tenant, actor=None)
    assert AuditLog.objects.filter(tenant=tenant, action="tenant.reinstate").count() == 1


def test_suspended_tenant_can_still_authenticate(tenant):
    """Tokens keep working for reads (and for paying through billing endpoints)."""
    token = token_for(tenant, role=Role.OWNER)
    tenant_suspend(tenant=tenant, actor=None, reason="unpaid")
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/v1/jobs/").status_code == 200
