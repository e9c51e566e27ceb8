"""Portal pages: each renders for its tenant, hides other tenants (404), respects roles."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import ApiToken, Role
from scheduler.models import Job, JobLogChunk, JobState
from tests.factories import member_add
from tests.portal.conftest import job_make, job_ran

pytestmark = pytest.mark.django_db


def test_anonymous_is_sent_to_log_in(client):
    response = client.get(reverse("portal:dashboard"))
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


def test_user_without_tenant_gets_a_clear_page(client, rules):
    from tests.factories import UserFactory

    client.force_login(UserFactory())
    response = client.get(reverse("portal:dashboard"))
    assert response.status_code == 403
    assert b"not a member of any tenant" in response.content


def test_every_page_renders_for_the_owner(client_for, tenant, node):
    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user, name="resnet"), node)
    for name, kwargs in [
        ("portal:dashboard", {}),
        ("portal:dashboard_live", {}),
        ("portal:jobs", {}),
        ("portal:submit", {}),
        ("portal:usage", {}),
        ("portal:team", {}),
        ("portal:job", {"pk": job.pk}),
        ("portal:job_live", {"pk": job.pk}),
        ("portal:job_log", {"pk": job.pk}),
        ("portal:job_metrics", {"pk": job.pk}),
    ]:
        response = owner.get(reverse(name, kwargs=kwargs))
        assert response.status_code == 200, (name, response.status_code)
    page = owner.get(reverse("portal:job", kwargs={"pk": job.pk})).content.decode()
    assert "GPU-portal-0" in page and "exclusive" in page and "$0.0021" in page


@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("portal:job", "get"),
        ("portal:job_live", "get"),
        ("portal:job_log", "get"),
        ("portal:job_metrics", "get"),
        ("portal:job_cancel", "post"),
    ],
)
def test_another_tenants_job_is_404(client_for, tenant, other_tenant, name, method):
    theirs = job_make(other_tenant, name="secret-run")
    mine = client_for(tenant)
    response = getattr(mine, method)(reverse(name, kwargs={"pk": theirs.pk}))
    assert response.status_code == 404
    with scopes_disabled():
        assert Job.objects.get(pk=theirs.pk).state == JobState.QUEUED


def test_another_tenants_job_is_invisible_in_lists_and_resubmit(client_for, tenant, other_tenant):
    theirs = job_make(other_tenant, name="secret-run")
    mine = client_for(tenant)
    for name in ("portal:dashboard", "portal:jobs", "portal:usage"):
        assert b"secret-run" not in mine.get(reverse(name)).content
    assert mine.get(reverse("portal:submit") + f"?from={theirs.pk}").status_code == 404
    # Bulk cancel ignores ids of other tenants.
    mine.post(reverse("portal:jobs_cancel"), {"job": [theirs.pk]})
    with scopes_disabled():
        assert Job.objects.get(pk=theirs.pk).state == JobState.QUEUED


def test_another_tenants_token_cannot_be_revoked(client_for, tenant, other_tenant):
    from accounts.services import token_create

    their_user = member_add(other_tenant, role=Role.OWNER)
    theirs = token_create(tenant=other_tenant, user=their_user, name="ci").token
    mine = client_for(tenant)
    assert mine.post(reverse("portal:token_revoke", kwargs={"pk": theirs.pk})).status_code == 404
    assert theirs.prefix.encode() not in mine.get(reverse("portal:team")).content
    with scopes_disabled():
        assert ApiToken.objects.get(pk=theirs.pk).revoked_at is None


def test_viewer_reads_but_cannot_submit_or_cancel(client_for, tenant):
    owner = client_for(tenant)
    job = job_make(tenant, user=owner.user)
    viewer = client_for(tenant, role=Role.VIEWER)
    assert viewer.get(reverse("portal:job", kwargs={"pk": job.pk})).status_code == 200
    page = viewer.get(reverse("portal:submit")).content.decode()
    assert "can read jobs but not submit them" in page
    response = viewer.post(reverse("portal:submit"), {"kind": "training", "gpus": "1", "command": "python x.py"})
    assert response.status_code == 403
    assert viewer.post(reverse("portal:job_cancel", kwargs={"pk": job.pk})).status_code == 403
    assert viewer.post(reverse("portal:jobs_cancel"), {"job": [job.pk]}).status_code == 403
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 1
        assert Job.objects.get(pk=job.pk).state == JobState.QUEUED


def test_member_cancels_own_job_but_not_a_colleagues(client_for, tenant):
    alice = client_for(tenant, role=Role.MEMBER)
    bob = client_for(tenant, role=Role.MEMBER)
    alices = job_make(tenant, user=alice.user)
    assert bob.post(reverse("portal:job_cancel", kwargs={"pk": alices.pk})).status_code == 403
    bob.post(reverse("portal:jobs_cancel"), {"job": [alices.pk]})
    with scopes_disabled():
        assert Job.objects.get(pk=alices.pk).state == JobState.QUEUED
    assert alice.post(reverse("portal:job_cancel", kwargs={"pk": alices.pk})).status_code == 302
    with scopes_disabled():
        assert Job.objects.get(pk=alices.pk).state == JobState.CANCELLED


def test_tenant_switch_changes_what_the_pages_show(client_for, tenant, other_tenant):
    owner = client_for(tenant)
    member_add(other_tenant, role=Role.VIEWER, user=owner.user)
    job_make(tenant, name="in-a")
    job_make(other_tenant, name="in-b")
    assert b"in-a" in owner.get(reverse("portal:jobs")).content
    response = owner.post(reverse("portal:tenant_switch"), {"tenant": other_tenant.pk, "next": "/jobs/"})
    assert response.status_code == 302 and response["Location"] == "/jobs/"
    page = owner.get(reverse("portal:jobs")).content
    assert b"in-b" in page and b"in-a" not in page
    # A tenant the user is not in cannot be chosen.
    from tests.factories import TenantFactory

    stranger = TenantFactory(slug="tenant-c")
    assert owner.post(reverse("portal:tenant_switch"), {"tenant": stranger.pk}).status_code == 404


def test_job_log_partial_appends_from_the_offset(client_for, tenant, node):
    owner = client_for(tenant)
    job = job_make(tenant, user=owner.user)
    with scopes_disabled():
        JobLogChunk.objects.create(tenant=tenant, job=job, offset=0, data=b"epoch 1\n")
        JobLogChunk.objects.create(tenant=tenant, job=job, offset=8, data=b"epoch 2 <done>\n")
    url = reverse("portal:job_log", kwargs={"pk": job.pk})
    first = owner.get(url + "?offset=0").content.decode()
    assert "epoch 1\nepoch 2 &lt;done&gt;" in first  # escaped: job output is never HTML
    assert 'hx-swap-oob="beforeend:#log-text"' in first
    assert "offset=23" in first  # the poller continues where this read ended
    assert "epoch" not in owner.get(url + "?offset=23").content.decode()
    assert owner.get(url + "?offset=-1").status_code == 400


def test_metrics_json_gives_chart_points(client_for, tenant, node):
    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user), node, windows=3)
    body = owner.get(reverse("portal:job_metrics", kwargs={"pk": job.pk})).json()
    assert body["sm_util_pct"] == [50.0, 60.0, 70.0]
    assert body["power_w"] == [300.0, 300.0, 300.0]
    assert body["memory_mb"] == [1000, 1001, 1002]
    assert body["done"] is True
    later = owner.get(reverse("portal:job_metrics", kwargs={"pk": job.pk}) + f"?after={body['t'][1]}").json()
    assert later["t"] == body["t"][2:]
    assert later["cost"] == body["cost"]


def test_an_expired_session_sends_live_parts_to_the_login_page(client):
    response = client.get(
        reverse("portal:dashboard_live"), HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL="http://testserver/jobs/?q=x"
    )
    assert response.status_code == 204
    assert response["HX-Redirect"] == "/accounts/login/?next=%2Fjobs%2F%3Fq%3Dx"


def test_bulk_cancel_never_redirects_off_site(client_for, tenant):
    owner = client_for(tenant)
    for data in ({"next": "https://evil.test/"}, {"next": "//evil.test/", "job": ["1"]}):
        response = owner.post(reverse("portal:jobs_cancel"), data)
        assert response.status_code == 302 and response["Location"] == reverse("portal:jobs")
