"""The web's request series (``gpushare.observability.metrics``), recorded by the request's own
middleware: by route, method and status, and the duration by route and method. The series a real
server's scrape adds up across workers is tested in test_readiness.py."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

RESPONSES = "django_http_responses_total_by_status_view_method_total"
LATENCY = "django_http_requests_latency_seconds_by_view_method_count"


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.django_db
def test_a_request_is_counted_once_by_route_method_and_status(client):
    before = sample(RESPONSES, status="401", view="job-list", method="GET")
    timed = sample(LATENCY, view="job-list", method="GET")
    assert client.get("/api/v1/jobs/").status_code == 401
    assert sample(RESPONSES, status="401", view="job-list", method="GET") == before + 1
    assert sample(LATENCY, view="job-list", method="GET") == timed + 1


@pytest.mark.django_db
def test_no_route_and_a_made_up_method_are_one_label_each(client):
    """A client cannot grow the series: a path no route matches and a verb outside HTTP's are each one value."""
    unrouted = sample(RESPONSES, status="404", view="<unnamed view>", method="GET")
    invented = sample(LATENCY, view="job-list", method="<invalid method>")
    assert client.get("/no/such/page-xyz/").status_code == 404
    client.generic("BREW", "/api/v1/jobs/")
    client.generic("MAKECOFFEE", "/api/v1/jobs/")
    assert sample(RESPONSES, status="404", view="<unnamed view>", method="GET") == unrouted + 1
    assert sample(LATENCY, view="job-list", method="<invalid method>") == invented + 2
    assert sample(LATENCY, view="job-list", method="BREW") == 0


@pytest.mark.django_db
def test_probes_are_not_traffic(client):
    def responses() -> float:
        return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == RESPONSES)

    before = responses()
    assert client.get("/healthz").status_code == 200
    assert client.get("/api/v1/jobs/").status_code == 401
    assert responses() == before + 1
