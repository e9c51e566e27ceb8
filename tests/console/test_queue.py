"""The queue view and its audited actions (cancel, change class)."""

from __future__ import annotations

from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from scheduler.models import Job
from scheduler.services import JobSpec, job_submit
from tests.factories import member_add


def queued_job(tenant, *, gpus: int = 1, priority: str = "") -> Job:
    spec = JobSpec(kind="training", gpu_milli=gpus * 1000, command=["true"], priority=priority)
    return job_submit(tenant=tenant, user=member_add(tenant), spec=spec)


def test_queue_lists_jobs_in_scheduler_order(staff_client, tenant, other_tenant, rules):
    low = queued_job(tenant, priority="preemptible")
    high = queued_job(other_tenant, priority="serving")
    response = staff_client.get(reverse("console:queue"))
    rows = [row.job.pk for row in response.context["rows"]]
    assert rows == [high.pk, low.pk]
    assert f'data-job="{high.pk}"'.encode() in response.content


def test_cancel_from_the_queue_is_audited(staff_client, operator, tenant, rules):
    job = queued_job(tenant)
    response = staff_client.post(reverse("console:job-cancel", args=[job.pk]))
    assert response.status_code == 302
    with scopes_disabled():
        job.refresh_from_db()
    assert job.state == "cancelled"
    entry = AuditLog.objects.get(action="job.cancel")
    assert entry.actor == operator and entry.tenant == tenant and entry.target == f"job {job.pk}"
    assert entry.before["state"] == "queued" and entry.after["state"] == "cancelled"


def test_change_class_is_audited_and_reorders_the_queue(staff_client, operator, tenant, other_tenant, rules):
    first = queued_job(other_tenant)
    moved = queued_job(tenant, priority="preemptible")
    staff_client.post(reverse("console:job-reclass", args=[moved.pk]), {"priority": "serving"})
    with scopes_disabled():
        moved.refresh_from_db()
        assert moved.priority.name == "serving"
        assert moved.events.last().detail == "class changed from preemptible to serving by the operator"
    entry = AuditLog.objects.get(action="job.priority_change")
    assert (entry.before["priority"], entry.after["priority"]) == ("preemptible", "serving")
    assert entry.actor == operator
    rows = [row.job.pk for row in staff_client.get(reverse("console:queue")).context["rows"]]
    assert rows == [moved.pk, first.pk]


def test_unknown_class_or_job_is_refused_clearly(staff_client, tenant, rules):
    job = queued_job(tenant)
    response = staff_client.post(reverse("console:job-reclass", args=[job.pk]), {"priority": "nope"}, follow=True)
    assert b"Choose an existing priority class." in response.content
    assert staff_client.post(reverse("console:job-cancel", args=[999999])).status_code == 404
    assert not AuditLog.objects.filter(action__startswith="job.").exists()


def test_a_finished_job_cannot_be_cancelled(staff_client, tenant, rules):
    job = queued_job(tenant)
    staff_client.post(reverse("console:job-cancel", args=[job.pk]))
    response = staff_client.post(reverse("console:job-cancel", args=[job.pk]), follow=True)
    assert b"already cancelled" in response.content
    assert AuditLog.objects.filter(action="job.cancel").count() == 1
