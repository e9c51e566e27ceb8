"""REST v1 billing endpoints: tenant-scoped, scoped tokens, clear 4xx errors, cross-tenant 404."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from billing.models import Invoice
from billing.services import usage_windows_ingest
from billing.services.invoices import invoices_close_month
from tests.billing.conftest import ms, window
from tests.query_counts import statements_besides_auth

pytestmark = pytest.mark.django_db

SCOPES = ["usage:read", "billing:read"]


@pytest.fixture
def usage(fleet, tenant, other_tenant):
    node = fleet.node()
    a = fleet.job(tenant, node=node, gpu_milli=1000)
    b = fleet.job(other_tenant, node=node, gpu_milli=1000, gpu_indexes=[1])
    t = ms(2026, 3, 30, 12)
    usage_windows_ingest(node=node, windows=[window(a, 0, t, t + 3_600_000 // 4, sm_util_ms=450_000)])
    usage_windows_ingest(node=node, windows=[window(b, 0, t, t + 60_000)])
    invoices_close_month(month=date(2026, 3, 1))
    return a, b


def test_usage_grouped_by_day_job_and_model(usage, tenant, api_client_for):
    client = api_client_for(tenant, scopes=SCOPES)
    job, _ = usage
    params = {"start": "2026-03-01T00:00:00Z", "end": "2026-04-01T00:00:00Z"}

    by_day = client.get("/api/v1/usage/", {**params, "group_by": "day"}).json()
    by_job = client.get("/api/v1/usage/", {**params, "group_by": "job"}).json()
    by_model = client.get("/api/v1/usage/", {**params, "group_by": "gpu_model"}).json()

    assert by_day["results"] == [
        {"day": "2026-03-30", "held_gpu_seconds": "900.000", "used_gpu_seconds": "450.000", "cost": "0.6225000000"}
    ]
    assert [r["job"] for r in by_job["results"]] == [job.pk]  # not the other tenant's job
    assert by_model["results"][0]["gpu_model"] == "H100-80GB"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"start": "2026-03-02T00:00:00Z", "end": "2026-03-01T00:00:00Z"}, "end"),
        ({"start": "yesterday", "end": "2026-03-01T00:00:00Z"}, "start"),
        ({"start": "2026-03-01T00:00:00Z", "end": "2026-03-02T00:00:00Z", "group_by": "week"}, "group_by"),
    ],
)
def test_usage_bad_input_is_a_clear_400(tenant, api_client_for, params, field):
    response = api_client_for(tenant, scopes=SCOPES).get("/api/v1/usage/", params)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid"
    assert field in response.json()["error"]["fields"]


def test_invoices_list_detail_csv_and_cross_tenant_404(usage, tenant, other_tenant, api_client_for):
    client = api_client_for(tenant, scopes=SCOPES)
    with scopes_disabled():
        mine = Invoice.objects.get(tenant=tenant)
        theirs = Invoice.objects.get(tenant=other_tenant)

    listing = client.get("/api/v1/invoices/").json()
    detail = client.get(f"/api/v1/invoices/{mine.pk}/").json()
    export = client.get(f"/api/v1/invoices/{mine.pk}/csv/")

    assert [i["id"] for i in listing["results"]] == [mine.pk]
    assert detail["month"] == "2026-03" and detail["total"] == "0.62"
    assert detail["lines"][0]["gpu_hours"] == "0.2500" and detail["lines"][0]["sm_util_hours"] == "0.1250"
    assert export["Content-Type"] == "text/csv" and str(usage[0].pk) in export.content.decode()
    for path in (f"/api/v1/invoices/{theirs.pk}/", f"/api/v1/invoices/{theirs.pk}/csv/"):
        response = client.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_invoice_list_query_count_is_flat(fleet, tenant, api_client_for):
    client = api_client_for(tenant, scopes=SCOPES)
    node = fleet.node()
    job = fleet.job(tenant, node=node)

    def month_of_usage(month: int):
        usage_windows_ingest(node=node, windows=[window(job, month, ms(2026, month, 2), ms(2026, month, 2, 0, 1))])
        invoices_close_month(month=date(2026, month, 1))

    month_of_usage(1)
    client.get("/api/v1/invoices/")  # the token's first use also records last_used_at
    with CaptureQueriesContext(connection) as one:
        client.get("/api/v1/invoices/")
    for m in range(2, 6):
        month_of_usage(m)
    with CaptureQueriesContext(connection) as five:
        assert len(client.get("/api/v1/invoices/").json()["results"]) == 5
    assert len(statements_besides_auth(five)) == len(statements_besides_auth(one))


def test_billing_endpoints_need_their_scope(tenant, api_client_for):
    client = api_client_for(tenant, scopes=["jobs:read"])
    assert client.get("/api/v1/invoices/").status_code == 403
    assert client.get("/api/v1/usage/", {"start": "2026-03-01", "end": "2026-03-02"}).status_code == 403


def test_estimate_from_request_and_prices(rules, tenant, api_client_for):
    client = api_client_for(tenant, scopes=SCOPES)

    training = client.get(
        "/api/v1/estimate/", {"kind": "training", "gpus": 2, "max_runtime_seconds": 5400, "gpu_model": "H100-80GB"}
    )
    slices = client.get(
        "/api/v1/estimate/",
        {"kind": "inference", "gpus": "0.25", "max_runtime_seconds": 3600, "priority": "preemptible"},
    )

    assert training.status_code == 200
    assert training.json()["results"] == [
        {
            "gpu_model": "H100-80GB",
            "mode": "dedicated",
            "priority": "standard",
            "gpus": 2.0,
            "max_runtime_seconds": 5400,
            "price_per_gpu_hour": "2.4900",
            "multiplier": "1.000",
            "cost_per_hour": "4.98",
            "max_cost": "7.47",
        }
    ]
    # cheapest first: L4 shared 0.85 × 0.25 × 0.6 = 0.1275 → 0.13
    assert [(r["gpu_model"], r["max_cost"]) for r in slices.json()["results"]] == [
        ("L4-24GB", "0.13"),
        ("H100-80GB", "0.45"),
    ]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"kind": "training", "gpus": "0.5", "max_runtime_seconds": 60}, "gpus"),
        ({"kind": "training", "gpus": 1, "max_runtime_seconds": 0}, "max_runtime_seconds"),
        ({"kind": "training", "gpus": 1, "max_runtime_seconds": 60, "priority": "gold"}, "priority"),
        ({"kind": "training", "gpus": 1, "max_runtime_seconds": 60, "gpu_model": "TPU"}, "gpu_model"),
        ({"kind": "cooking", "gpus": 1, "max_runtime_seconds": 60}, "kind"),
    ],
)
def test_estimate_bad_input(rules, tenant, api_client_for, params, field):
    response = api_client_for(tenant, scopes=SCOPES).get("/api/v1/estimate/", params)
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"]


def test_spend_this_month(fleet, tenant, api_client_for):
    response = api_client_for(tenant, scopes=SCOPES).get("/api/v1/spend/")
    assert response.status_code == 200
    assert Decimal(response.json()["spent"]) == 0


def test_invoices_are_for_owners_and_filter_by_state(usage, tenant, api_client_for):
    member = api_client_for(tenant, role="member", scopes=SCOPES)
    owner = api_client_for(tenant, scopes=SCOPES)

    refused = member.get("/api/v1/invoices/")
    draft = owner.get("/api/v1/invoices/", {"state": "draft"}).json()["results"]
    paid = owner.get("/api/v1/invoices/", {"state": "paid"}).json()["results"]
    bad = owner.get("/api/v1/invoices/", {"state": "cheap"})

    assert refused.status_code == 403 and "billing.read" in refused.json()["error"]["message"]
    assert member.get("/api/v1/usage/", {"start": "2026-03-01", "end": "2026-04-01"}).status_code == 200
    assert len(draft) == 1 and paid == []
    assert bad.status_code == 400 and "state" in bad.json()["error"]["fields"]


def test_spend_projection_and_alert_flag(fleet, tenant):
    from datetime import UTC, datetime

    from accounts.models import TenantQuota
    from billing.selectors import spend_summary

    node = fleet.node()
    job = fleet.job(tenant, node=node)
    t = ms(2026, 6, 30, 10)  # 14 h before the month ends
    usage_windows_ingest(node=node, windows=[window(job, s, t + s * 600_000, t + (s + 1) * 600_000) for s in range(6)])
    with scopes_disabled():
        TenantQuota.objects.create(tenant=tenant, monthly_spend_limit=Decimal("3.00"), budget_alert_percent=80)
        summary = spend_summary(tenant=tenant, at=datetime(2026, 6, 30, 11, tzinfo=UTC))

    assert summary.spent == Decimal("2.49")  # one H100-hour
    assert summary.projected == Decimal("2.49") + 13 * Decimal("2.49")  # the last hour's rate for 13 more hours
    assert summary.alert is True and summary.limit == Decimal("3.00")
