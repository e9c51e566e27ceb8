"""Portal pages for inference endpoints: list and detail with traffic, latency, replicas and cost."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Role
from endpoints.models import Endpoint, ScalingEvent
from endpoints.services import EndpointSpec, endpoint_create, endpoint_delete, endpoint_load_record
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def deploy(tenant, name: str = "llm") -> Endpoint:
    spec = EndpointSpec(name=name, command=["python", "serve.py"], gpu_milli=250, min_replicas=0, max_replicas=4)
    endpoint = endpoint_create(tenant=tenant, user=None, spec=spec)
    now = timezone.now().replace(second=0, microsecond=0)
    minutes = [
        {"minute": int((now - timedelta(minutes=m)).timestamp()), "requests": 60 * (m + 1), "errors": m,
         "peak": 2, "latency_ms": {"p50": 40 + m, "p95": 80, "p99": 120 + m}}
        for m in range(3)
    ]  # fmt: skip
    endpoint_load_record(endpoint_id=endpoint.pk, stats={"inflight": 1, "queued": 0, "minutes": minutes})
    with scopes_disabled():
        ScalingEvent.objects.create(
            tenant=tenant, endpoint=endpoint, from_replicas=0, to_replicas=2, reason="7 in flight > 2 x 2"
        )
        return Endpoint.objects.get(pk=endpoint.pk)


def test_the_list_shows_each_endpoint_with_its_last_hour(client_for, tenant, settings):
    settings.GPUSHARE = {**settings.GPUSHARE, "GATEWAY_URL": "https://gw.example.test/"}
    endpoint = deploy(tenant)
    page = client_for(tenant, role=Role.VIEWER).get(reverse("portal:endpoints")).content.decode()
    assert f'data-endpoint="{endpoint.pk}"' in page
    assert "https://gw.example.test/e/tenant-a/llm/" in page
    assert ">360 <" in page and "(3 failed)" in page  # 60+120+180 requests, 0+1+2 failed, in the last hour
    assert "80 ms" in page and "0–4" in page and "¼ GPU" in page


def test_the_list_says_how_to_deploy_when_there_is_none(client_for, tenant):
    page = client_for(tenant).get(reverse("portal:endpoints")).content.decode()
    assert "No endpoints yet" in page and "gpushare endpoint deploy" in page


def test_the_detail_page_carries_the_charts_data_and_the_decisions(client_for, tenant):
    endpoint = deploy(tenant)
    response = client_for(tenant).get(reverse("portal:endpoint", kwargs={"pk": endpoint.pk}), {"window": "6h"})
    assert response.status_code == 200
    page = response.content.decode()
    series = json.loads(page.split('<script id="endpoint-series" type="application/json">')[1].split("</script>")[0])
    assert series["window"] == "6h" and sum(series["requests"]) == 360 and sum(series["errors"]) == 3
    assert (
        len(json.loads(page.split('id="endpoint-cost" type="application/json">')[1].split("</script>")[0])["cost"])
        == 30
    )
    assert "7 in flight &gt; 2 x 2" in page and "0 → 2" in page
    assert 'aria-current="true">6h<' in page and "scales to zero" in page


def test_the_series_endpoint_feeds_the_live_charts(client_for, tenant):
    endpoint = deploy(tenant)
    client = client_for(tenant)
    body = client.get(reverse("portal:endpoint_series", kwargs={"pk": endpoint.pk}), {"window": "1h"}).json()
    assert len(body["t"]) == 60 and body["requests"][-3:] == [180, 120, 60]
    bad = client.get(reverse("portal:endpoint_series", kwargs={"pk": endpoint.pk}), {"window": "forever"})
    assert bad.status_code == 400 and "1h, 6h, 24h, 7d" in bad.json()["error"]
    page = client.get(reverse("portal:endpoint", kwargs={"pk": endpoint.pk}), {"window": "forever"})
    assert page.status_code == 400


@pytest.mark.parametrize("name", ["portal:endpoint", "portal:endpoint_series"])
def test_another_tenants_endpoint_is_404(client_for, tenant, name):
    theirs = deploy(TenantFactory(slug="rival"))
    assert client_for(tenant).get(reverse(name, kwargs={"pk": theirs.pk})).status_code == 404


def test_a_deleted_endpoint_leaves_the_list_and_its_page(client_for, tenant):
    endpoint = deploy(tenant)
    endpoint_delete(endpoint=endpoint, user=None)
    client = client_for(tenant)
    assert f'data-endpoint="{endpoint.pk}"' not in client.get(reverse("portal:endpoints")).content.decode()
    assert client.get(reverse("portal:endpoint", kwargs={"pk": endpoint.pk})).status_code == 404


def test_anonymous_is_sent_to_log_in(client):
    assert client.get(reverse("portal:endpoints"))["Location"].startswith("/accounts/login/")


def test_a_replicas_job_page_links_to_its_endpoint(client_for, tenant):
    from endpoints.models import Replica
    from tests.portal.conftest import job_make

    endpoint = deploy(tenant)
    job = job_make(tenant, kind="inference", gpus=250)
    with scopes_disabled():
        Replica.objects.create(tenant=tenant, endpoint=endpoint, job=job, version=1, port=20001)
    page = client_for(tenant).get(reverse("portal:job", kwargs={"pk": job.pk})).content.decode()
    assert f'a replica of endpoint <a href="{reverse("portal:endpoint", kwargs={"pk": endpoint.pk})}">llm</a>' in page


def test_the_list_queries_do_not_grow_with_endpoints(client_for, tenant, django_assert_max_num_queries):
    client = client_for(tenant)
    deploy(tenant, "one")
    with CaptureQueriesContext(connection) as one:
        client.get(reverse("portal:endpoints"))
    for n in range(5):
        deploy(tenant, f"more-{n}")
    with django_assert_max_num_queries(len(one)):
        page = client.get(reverse("portal:endpoints")).content.decode()
    assert page.count("data-endpoint=") == 6
