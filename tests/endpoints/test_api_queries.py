"""The endpoints list API costs the same number of queries however many endpoints a tenant has."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from endpoints.services import EndpointSpec, endpoint_create

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("rules")]


def deploy(tenant, name: str) -> None:
    endpoint_create(tenant=tenant, user=None, spec=EndpointSpec(name=name, command=["python", "s.py"], gpu_milli=250))


def test_list_queries_do_not_grow_with_endpoints(tenant, api_client_for, django_assert_max_num_queries):
    client = api_client_for(tenant)
    deploy(tenant, "one")
    with CaptureQueriesContext(connection) as one:
        assert client.get("/api/v1/endpoints/").status_code == 200
    for n in range(5):
        deploy(tenant, f"more-{n}")
    with django_assert_max_num_queries(len(one)):
        body = client.get("/api/v1/endpoints/").json()
    assert len(body["results"] if isinstance(body, dict) else body) == 6
