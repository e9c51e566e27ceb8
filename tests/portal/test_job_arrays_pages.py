"""Job arrays in the portal: a task shows its array; the array's page lists its tasks with their states
and cancels the unfinished ones; another tenant's array is 404."""

from __future__ import annotations

import pytest
from django.test import Client
from django_scopes import scopes_disabled

from accounts.models import Role
from scheduler.array_services import job_array_submit
from scheduler.arrays import array_parse
from scheduler.models import Job, JobState
from scheduler.services import JobSpec, job_cancel
from tests.factories import member_add

pytestmark = pytest.mark.django_db


def logged_in(tenant, role=Role.OWNER):
    user = member_add(tenant, role=role)
    client = Client()
    client.force_login(user)
    return client, user


def array_make(tenant, user, count=3):
    spec = JobSpec(kind="inference", gpu_milli=125, command=["true"], name="sweep")
    return job_array_submit(tenant=tenant, user=user, spec=spec, array=array_parse({"count": count}))


def test_array_page_shows_tasks_and_cancels_the_unfinished(rules, tenant):
    client, user = logged_in(tenant)
    array = array_make(tenant, user)
    # Moments after the submit, before a scheduling pass made the tasks: the page makes and lists them.
    assert client.get(f"/jobs/?array={array.pk}").content.decode().count(f"array #{array.pk} [") == 3
    with scopes_disabled():
        first = Job.objects.filter(array=array).order_by("array_index").first()
        job_cancel(job=first, actor=user)
    page = client.get(f"/jobs/?array={array.pk}").content.decode()
    assert f"Array #{array.pk}" in page and "indices 0-2" in page
    assert page.count(f"array #{array.pk} [") == 3
    assert "Cancel all unfinished tasks" in page
    detail = client.get(f"/jobs/{first.pk}/").content.decode()
    assert "task 0 of" in detail and f"?array={array.pk}" in detail
    response = client.post(f"/jobs/arrays/{array.pk}/cancel/")
    assert response.status_code == 302
    with scopes_disabled():
        assert set(Job.objects.filter(array=array).values_list("state", flat=True)) == {JobState.CANCELLED}
    assert "Cancelling 2 unfinished tasks" in client.get(response["Location"]).content.decode()


def test_a_viewer_sees_the_array_but_may_not_cancel_it(rules, tenant):
    owner_client, owner = logged_in(tenant)
    array = array_make(tenant, owner)
    viewer, _ = logged_in(tenant, role=Role.VIEWER)
    assert "Cancel all unfinished tasks" not in viewer.get(f"/jobs/?array={array.pk}").content.decode()
    assert viewer.post(f"/jobs/arrays/{array.pk}/cancel/").status_code == 403
    with scopes_disabled():
        assert set(Job.objects.filter(array=array).values_list("state", flat=True)) == {JobState.QUEUED}


def test_another_tenants_array_is_404(rules, tenant, other_tenant):
    _, theirs = logged_in(other_tenant)
    array = array_make(other_tenant, theirs)
    client, _ = logged_in(tenant)
    assert client.get(f"/jobs/?array={array.pk}").status_code == 404
    assert client.get("/jobs/?array=x").status_code == 404
    assert client.post(f"/jobs/arrays/{array.pk}/cancel/").status_code == 404
    with scopes_disabled():
        array.refresh_from_db()
        assert not array.tasks_made and not Job.objects.filter(array=array).exists()  # nothing made or cancelled
