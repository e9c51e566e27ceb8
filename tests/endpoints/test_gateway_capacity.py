"""The gateway answers 503 with Retry-After at once when no replica can be ready soon (no capacity to
place one), instead of holding the request for the whole cold-start timeout; a cold start is held."""

from __future__ import annotations

import time

import pytest
import requests
from django_scopes import scopes_disabled

from endpoints.gateway import no_capacity
from endpoints.models import Endpoint, Replica
from endpoints.selectors import FIRST_PASS_PENDING, EndpointRoute, Route, routing_table
from scheduler.models import Job, JobState
from tests.endpoints.test_endpoints_integration import SCOPES, deploy
from tests.factories import TenantFactory, priority, token_for


def route(*, replicas=(), max_replicas=1, unplaceable=0) -> EndpointRoute:
    return EndpointRoute(1, 1, "t", "e", "/health", 1, 60, tuple(replicas), max_replicas, unplaceable)


def test_no_capacity_rule():
    starting = Route(1, "127.0.0.1", 9000, "starting", 1)
    assert no_capacity(route(max_replicas=0))
    assert no_capacity(route(unplaceable=1))
    assert not no_capacity(route())  # just asked for: no pass has looked at it yet, a cold start
    assert not no_capacity(route(unplaceable=1, replicas=[starting]))  # another one is starting


@pytest.mark.django_db
def test_routing_table_counts_replicas_a_pass_could_not_place(rules, tenant):
    with scopes_disabled():
        endpoint = Endpoint.objects.create(tenant=tenant, name="chat", command=["serve"], gpu_milli=250, max_replicas=3)
        for reason in (FIRST_PASS_PENDING, "waiting for 1 free 1/4 slice (none fits now)"):
            job = Job.objects.create(
                tenant=tenant, kind="inference", mode="shared", gpu_milli=250, command=["serve"],
                priority=priority("serving"), max_runtime_s=3600, state=JobState.QUEUED, pending_reason=reason,
            )  # fmt: skip
            Replica.objects.create(tenant=tenant, endpoint=endpoint, job=job, version=1, port=9000 + job.pk)
    entry = routing_table()[(tenant.slug, "chat")]
    assert entry.unplaceable == 1 and entry.max_replicas == 3 and entry.replicas == ()


@pytest.mark.integration
def test_no_capacity_is_503_at_once_not_after_the_hold(platform, gateway):
    """No node at all: the autoscaler asks for a replica, the pass cannot place it, the request held for it
    is answered 503 with Retry-After within seconds (the gateway's hold here is 90 s)."""
    tenant = TenantFactory(slug="nocap")
    token = token_for(tenant, scopes=SCOPES)
    deploy(platform, token, max_replicas=1)
    auth = {"Authorization": f"Bearer {token}"}
    started = time.monotonic()
    answer = requests.post(f"{gateway}/e/nocap/echo/predict", data=b"x", headers=auth, timeout=120)
    elapsed = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "unavailable" and "no capacity" in answer.json()["error"]["message"]
    assert int(answer.headers["Retry-After"]) >= 1
    assert elapsed < 20, elapsed
    # The next request does not wait at all.
    started = time.monotonic()
    again = requests.post(f"{gateway}/e/nocap/echo/predict", data=b"x", headers=auth, timeout=120)
    assert again.status_code == 503 and time.monotonic() - started < 2
