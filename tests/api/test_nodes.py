"""Operator-only node endpoints: list, cordon, drain, uncordon."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled
from rest_framework.test import APIClient

from agents.models import Node
from scheduler.models import Allocation, Job, JobState
from tests.factories import UserFactory, member_add

from .helpers import assert_error, job_make, node_make

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator():
    client = APIClient()
    client.force_login(UserFactory(username="ops@example.test", is_staff=True))
    return client


def test_operator_sees_the_fleet_and_who_holds_which_gpu(rules, tenant, operator, django_assert_max_num_queries):
    node = node_make("node-a")
    node_make("node-b", gpus=1, model="L4-24GB")
    job = job_make(tenant)
    gpu = node.gpus.get(index=1)
    with scopes_disabled():
        Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, node=node)
    for i in range(5):
        node_make(f"node-x{i}")
    with django_assert_max_num_queries(8):
        body = operator.get("/api/v1/nodes/").json()
    assert body["count"] == 7
    first = body["results"][0]
    assert first["name"] == "node-a" and first["state"] == "up"
    assert [g["holders"] for g in first["gpus"]] == [[], [{"job": job.pk, "tenant": "tenant-a", "share": 1.0}]]
    assert operator.get("/api/v1/nodes/node-b/").json()["gpus"][0]["model"] == "L4-24GB"
    assert operator.get("/api/v1/nodes/?state=down").json()["count"] == 0


def test_cordon_drain_uncordon(rules, operator):
    node_make("node-a")
    cordoned = operator.post("/api/v1/nodes/node-a/cordon/", {"reason": "bad fan"}, format="json")
    assert cordoned.status_code == 200, cordoned.content
    assert cordoned.json()["state"] == "cordoned"
    assert Node.objects.get(name="node-a").state_reason == "bad fan"
    assert_error(operator.post("/api/v1/nodes/node-a/drain/"), 409, "conflict")  # a cordoned node cannot drain
    assert operator.post("/api/v1/nodes/node-a/uncordon/").json()["state"] == "up"
    # An empty node that drains is cordoned at once.
    assert operator.post("/api/v1/nodes/node-a/drain/").json()["state"] == "cordoned"
    assert_error(operator.post("/api/v1/nodes/no-such-node/cordon/"), 404, "not_found")
    assert_error(
        operator.post("/api/v1/nodes/node-a/cordon/", {"reason": "x" * 201}, format="json"), 400, "invalid", "reason"
    )


def test_a_staff_users_token_works_too(rules, tenant, api_client_for):
    node_make("node-a")
    staff = UserFactory(username="staff@example.test", is_staff=True)
    member_add(tenant, user=staff)
    client = api_client_for(tenant, user=staff)
    assert client.get("/api/v1/nodes/").json()["count"] == 1
    assert client.post("/api/v1/nodes/node-a/cordon/").json()["state"] == "cordoned"


def test_tenants_cannot_see_or_touch_nodes(rules, tenant, api_client_for, client):
    node_make("node-a")
    tenant_client = api_client_for(tenant)
    assert_error(tenant_client.get("/api/v1/nodes/"), 403, "forbidden")
    assert_error(tenant_client.get("/api/v1/nodes/node-a/"), 403, "forbidden")
    assert_error(tenant_client.post("/api/v1/nodes/node-a/cordon/"), 403, "forbidden")
    assert Node.objects.get(name="node-a").state == "up"
    client.force_login(UserFactory(username="not-staff@example.test"))
    assert_error(client.get("/api/v1/nodes/"), 403, "forbidden")
    assert_error(APIClient().get("/api/v1/nodes/"), 401, "unauthenticated")
