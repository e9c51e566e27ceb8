"""The roles table, role_allows, and the RoleAllows DRF permission on real token requests."""

from __future__ import annotations

import pytest
from django.urls import path
from django_scopes import scopes_disabled
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.test import APIClient

from accounts.models import Membership, Role
from accounts.permissions import ACTIONS, OWN_ONLY, RoleAllows, may_act_on, role_allows, role_for
from gpushare.api import TenantScopedMixin
from scheduler.models import Job
from scheduler.services import JobSpec, job_submit
from tests.factories import member_add, token_for

pytestmark = pytest.mark.django_db

EXPECTED = {
    # action: (owner, admin, member, viewer)
    "jobs.read": (True, True, True, True),
    "jobs.submit": (True, True, True, False),
    "jobs.cancel": (True, True, True, False),
    "jobs.cancel_any": (True, True, False, False),
    "tokens.create": (True, True, True, False),
    "tokens.revoke_any": (True, True, False, False),
    "members.manage": (True, True, False, False),
    "billing.read": (True, False, False, False),
    "billing.manage": (True, False, False, False),
    "audit.read": (True, False, False, False),
    "tenant.delete": (True, False, False, False),
}
ROLES = (Role.OWNER, Role.ADMIN, Role.MEMBER, Role.VIEWER)


@pytest.mark.parametrize("action_name", sorted(EXPECTED))
@pytest.mark.parametrize("role", ROLES)
def test_role_table(role, action_name):
    assert role_allows(role, action_name) is EXPECTED[action_name][ROLES.index(role)]


def test_unknown_action_and_missing_role_are_refused():
    assert not role_allows(Role.OWNER, "jobs.teleport")
    assert not role_allows(None, "jobs.read")
    assert set(OWN_ONLY) <= set(ACTIONS) and set(OWN_ONLY.values()) <= set(ACTIONS)


def test_own_only_rule():
    assert may_act_on(Role.MEMBER, "jobs.cancel", owner_id=5, user_id=5)
    assert not may_act_on(Role.MEMBER, "jobs.cancel", owner_id=6, user_id=5)
    assert not may_act_on(Role.MEMBER, "jobs.cancel", owner_id=None, user_id=5)
    assert may_act_on(Role.ADMIN, "jobs.cancel", owner_id=6, user_id=5)
    assert not may_act_on(Role.VIEWER, "jobs.cancel", owner_id=5, user_id=5)


# A small viewset that declares RoleAllows the way the API views do.
class RoleCheckedJobs(TenantScopedMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "jobs:read", "POST": "jobs:write"}
    required_actions = {"cancel": "jobs.cancel", "GET": "jobs.read", "POST": "jobs.submit"}
    owner_field = "submitted_by_id"

    def get_queryset(self):
        return Job.objects.filter(tenant=self.tenant)

    def list(self, request):
        return Response({"ids": list(self.get_queryset().values_list("pk", flat=True))})

    def create(self, request):
        return Response({"ok": True}, status=201)

    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        return Response({"cancelled": job.pk}, status=202)


urlpatterns = [
    path("t/jobs/", RoleCheckedJobs.as_view({"get": "list", "post": "create"})),
    path("t/jobs/<int:pk>/cancel/", RoleCheckedJobs.as_view({"post": "cancel"})),
]


def _job(tenant, user):
    return job_submit(tenant=tenant, user=user, spec=JobSpec(kind="training", gpu_milli=1000, command=["true"]))


@pytest.fixture
def jobs_urls(settings):
    settings.ROOT_URLCONF = __name__


def _client(tenant, user):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(tenant, user=user)}")
    return client


@pytest.mark.parametrize(
    ("role", "read", "submit", "cancel_own", "cancel_other"),
    [
        (Role.OWNER, 200, 201, 202, 202),
        (Role.ADMIN, 200, 201, 202, 202),
        (Role.MEMBER, 200, 201, 202, 403),
        (Role.VIEWER, 200, 403, 403, 403),
    ],
)
def test_role_allows_on_requests(jobs_urls, rules, tenant, role, read, submit, cancel_own, cancel_other):
    user = member_add(tenant, role=role)
    colleague = member_add(tenant, role=Role.MEMBER)
    own, other = _job(tenant, user), _job(tenant, colleague)
    client = _client(tenant, user)

    assert client.get("/t/jobs/").status_code == read
    response = client.post("/t/jobs/", {}, format="json")
    assert response.status_code == submit
    if submit == 403:
        assert response.json()["error"]["code"] == "forbidden"
        assert "jobs.submit" in response.json()["error"]["message"]
    assert client.post(f"/t/jobs/{own.pk}/cancel/").status_code == cancel_own
    response = client.post(f"/t/jobs/{other.pk}/cancel/")
    assert response.status_code == cancel_other
    if cancel_other == 403 and role == Role.MEMBER:
        assert "own objects" in response.json()["error"]["message"]


def test_token_acts_with_current_role(jobs_urls, rules, tenant):
    """Demote the token's creator: the same token loses the power at once; remove them: 401."""
    user = member_add(tenant, role=Role.ADMIN)
    client = _client(tenant, user)
    assert client.post("/t/jobs/", {}, format="json").status_code == 201
    with scopes_disabled():  # as the admin console saves it (a saved membership invalidates cached token checks)
        membership = Membership.objects.get(tenant=tenant, user=user)
        membership.role = Role.VIEWER
        membership.save()
    assert client.post("/t/jobs/", {}, format="json").status_code == 403
    assert client.get("/t/jobs/").status_code == 200
    assert role_for(user=user, tenant=tenant) == Role.VIEWER
    with scopes_disabled():
        Membership.objects.filter(tenant=tenant, user=user).delete()
    response = client.get("/t/jobs/")
    assert response.status_code == 401
    assert "no longer a member" in response.json()["error"]["message"]


def test_real_jobs_api_applies_the_roles(rules, tenant):
    """The jobs API declares RoleAllows: role and scope are both needed."""
    viewer, member, colleague = (member_add(tenant, role=r) for r in (Role.VIEWER, Role.MEMBER, Role.MEMBER))
    body = {"kind": "training", "gpus": 1, "command": ["true"]}
    all_scopes = ["jobs:read", "jobs:write", "usage:read", "billing:read"]

    as_viewer = APIClient()
    as_viewer.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(tenant, user=viewer, scopes=all_scopes)}")
    response = as_viewer.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 403 and "jobs.submit" in response.json()["error"]["message"]
    assert as_viewer.get("/api/v1/jobs/").status_code == 200

    theirs = _job(tenant, colleague)
    as_member = _client(tenant, member)
    mine = as_member.post("/api/v1/jobs/", body, format="json")
    assert mine.status_code == 201
    assert as_member.post(f"/api/v1/jobs/{theirs.pk}/cancel/").status_code == 403
    assert as_member.post(f"/api/v1/jobs/{mine.json()['id']}/cancel/").status_code == 202
