"""The endpoint pages in a real browser: from the list to the detail, whose charts draw the history."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from endpoints.services import EndpointSpec, endpoint_create, endpoint_load_record
from tests.browser.test_portal_flow import PASSWORD, owner_of

pytestmark = [pytest.mark.browser]


def test_owner_opens_an_endpoint_and_sees_traffic_latency_replicas_and_cost(live_server, rules, page_for, screenshot):
    tenant, owner = owner_of("umbrella")
    spec = EndpointSpec(name="llm", command=["python", "serve.py"], gpu_milli=250, max_replicas=4)
    endpoint = endpoint_create(tenant=tenant, user=owner, spec=spec)
    now = timezone.now().replace(second=0, microsecond=0)
    minutes = [
        {"minute": int((now - timedelta(minutes=m)).timestamp()), "requests": 30 + 10 * m, "errors": 0,
         "peak": 3, "latency_ms": {"p50": 20 + m, "p95": 60 + m, "p99": 90 + m}}
        for m in range(5)
    ]  # fmt: skip
    endpoint_load_record(endpoint_id=endpoint.pk, stats={"minutes": minutes})

    page = page_for(owner, password=PASSWORD)
    page.goto("/")
    page.locator("nav.mainnav a", has_text="Endpoints").click()
    page.wait_for_selector("#endpoints")
    row = page.locator(f'tr[data-endpoint="{endpoint.pk}"]')
    assert "llm" in row.inner_text() and "\t250\t" in row.inner_text()  # 30+40+50+60+70 requests in the last hour
    row.locator("a", has_text="llm").click()
    page.wait_for_selector('#endpoint-charts[data-points="60"]')
    drawn = page.evaluate(
        """() => ["rate", "latency", "replicas"].map(name => {
            const chart = Chart.getChart(document.querySelector(`[data-chart=${name}]`));
            return chart.data.datasets.map(d => d.data.filter(v => v !== null && v > 0).length);
        })"""
    )
    assert drawn[0][0] == 5 and drawn[1] == [5, 5, 5] and drawn[2] == [0, 0]  # no replica ran yet
    assert page.evaluate("() => Chart.getChart(document.querySelector('[data-cost-chart]')).data.labels.length") == 30
    page.locator("nav[aria-label=Window] a", has_text="24h").click()
    page.wait_for_selector('#endpoint-charts[data-points="96"]')
    screenshot(page, "20-endpoint-detail")
