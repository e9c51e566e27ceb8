"""An endpoint's history: per-minute traffic from the gateway, replicas over time, cost per day."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from django_scopes import scopes_disabled

from agents.models import Node
from billing.models import UsageWindow
from endpoints import metrics
from endpoints.gateway import MINUTE_SAMPLE, Minute, Traffic
from endpoints.models import Endpoint, EndpointMinute, Replica
from endpoints.services import EndpointSpec, endpoint_create, endpoint_load_record, endpoint_minutes_prune
from scheduler import services as scheduler_services
from tests.factories import TenantFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("rules")]

NOW = datetime(2026, 11, 29, 12, 30, 20, tzinfo=UTC)


def deploy(tenant, name: str = "echo") -> Endpoint:
    endpoint = endpoint_create(
        tenant=tenant, user=None, spec=EndpointSpec(name=name, command=["python", "serve.py"], gpu_milli=250)
    )
    with scopes_disabled():
        return Endpoint.objects.select_related("tenant").get(pk=endpoint.pk)


def minute(at: datetime, requests: int, *, errors: int = 0, p50=None, p95=None, p99=None) -> dict:
    latency = {k: v for k, v in (("p50", p50), ("p95", p95), ("p99", p99)) if v is not None}
    return {"minute": int(at.timestamp()), "requests": requests, "errors": errors, "peak": 3, "latency_ms": latency}


def report(endpoint: Endpoint, *minutes: dict) -> None:
    endpoint_load_record(endpoint_id=endpoint.pk, stats={"inflight": 0, "minutes": list(minutes)})


def rows(endpoint: Endpoint) -> list[tuple]:
    with scopes_disabled():
        return list(
            EndpointMinute.objects.filter(endpoint=endpoint).values_list("minute", "requests", "errors", "p95_ms")
        )


def replica(endpoint: Endpoint, port: int, *, created, ready=None, drained=None, stopped=None) -> Replica:
    job = scheduler_services.job_submit(
        tenant=endpoint.tenant,
        user=None,
        spec=scheduler_services.JobSpec(kind="inference", gpu_milli=250, command=["python", "serve.py"]),
    )
    with scopes_disabled():
        r = Replica.objects.create(tenant=endpoint.tenant, endpoint=endpoint, job=job, version=1, port=port)
        Replica.objects.filter(pk=r.pk).update(
            created_at=created,
            ready_at=ready,
            drain_started_at=drained,
            stopped_at=stopped,
            state=Replica.State.STOPPED if stopped else Replica.State.READY,
        )
    return r


# --- the gateway's minute counters --------------------------------------------------


def test_a_minute_keeps_a_bounded_uniform_sample_of_latencies():
    m = Minute(start=0)
    for ms in range(3 * MINUTE_SAMPLE):
        m.latency(float(ms))
    assert m.seen == 3 * MINUTE_SAMPLE and len(m.latencies) == MINUTE_SAMPLE
    # A uniform sample of 0..15000 has its median near the middle, not at the first 5000 values.
    assert 6000 < sorted(m.latencies)[MINUTE_SAMPLE // 2] < 9000
    assert set(m.summary()["latency_ms"]) == {"p50", "p95", "p99"}


def test_traffic_rolls_minutes_over_and_reports_only_busy_ones():
    random.seed(1)
    t = Traffic()
    t.this_minute(120.5).requests += 2
    t.this_minute(150.0).latency(12.0)
    t.this_minute(185.0)  # a quiet minute: opened, nothing counted
    t.this_minute(250.0).requests += 1  # rolls over: the quiet minute is dropped, the busy one kept
    assert [m.start for m in t.finished] == [120]
    assert t.finished[0].summary() == {
        "minute": 120,
        "requests": 2,
        "errors": 0,
        "peak": 0,
        "latency_ms": {"p50": 12.0, "p95": 12.0, "p99": 12.0},
    }


# --- recording: idempotent, whole minutes -------------------------------------------------


def test_a_repeated_report_rewrites_its_minute_instead_of_counting_twice(tenant):
    endpoint = deploy(tenant)
    at = NOW.replace(second=0)
    report(endpoint, minute(at, 10, p95=40))
    report(endpoint, minute(at, 10, p95=40))  # replayed
    assert rows(endpoint) == [(at, 10, 0, 40)]
    report(endpoint, minute(at, 25, errors=1, p95=55), minute(at + timedelta(minutes=1), 4, p95=30))
    assert rows(endpoint) == [(at, 25, 1, 55), (at + timedelta(minutes=1), 4, 0, 30)]


def test_a_report_for_a_deleted_endpoint_row_is_ignored(tenant):
    endpoint = deploy(tenant)
    endpoint_id = endpoint.pk
    with scopes_disabled():
        Endpoint.objects.filter(pk=endpoint_id).delete()
    endpoint_load_record(endpoint_id=endpoint_id, stats={"minutes": [minute(NOW, 3)]})
    with scopes_disabled():
        assert not EndpointMinute.objects.filter(endpoint_id=endpoint_id).exists()


def test_old_minutes_are_pruned(tenant):
    endpoint = deploy(tenant)
    now = timezone.now().replace(second=0, microsecond=0)
    report(endpoint, minute(now - timedelta(days=31), 5), minute(now - timedelta(days=1), 7))
    assert endpoint_minutes_prune(keep_days=30) == 1
    assert [r[1] for r in rows(endpoint)] == [7]


# --- the series -----------------------------------------------------------------------------


def test_series_per_minute_and_merged_into_longer_buckets(tenant):
    endpoint = deploy(tenant)
    base = NOW.replace(second=0)
    report(
        endpoint,
        minute(base - timedelta(minutes=2), 60, p50=10, p95=20, p99=30),
        minute(base - timedelta(minutes=1), 120, errors=6, p50=40, p95=90, p99=200),
        minute(base, 30, p50=12, p95=25, p99=26),
    )
    with scopes_disabled():
        hour = metrics.traffic_series(endpoint, window=metrics.window_named("1h"), now=NOW)
        six = metrics.traffic_series(endpoint, window=metrics.window_named("6h"), now=NOW)
    assert len(hour["t"]) == 60 and hour["t"][-1] == int(base.timestamp() * 1000)
    assert hour["requests"][-3:] == [60, 120, 30] and hour["requests_per_s"][-3:] == [1.0, 2.0, 0.5]
    assert hour["errors"][-3:] == [0, 6, 0] and hour["p99_ms"][-3:] == [30, 200, 26]
    assert hour["p50_ms"][0] is None  # no traffic: a gap, not a zero latency

    assert len(six["t"]) == 72 and six["step_seconds"] == 300
    # 12:28 and 12:29 share the 12:25 bucket: requests add up, p50 is request-weighted, p95/p99 the worst.
    assert six["requests"][-2:] == [180, 30] and six["errors"][-2:] == [6, 0]
    assert six["p50_ms"][-2] == round((60 * 10 + 120 * 40) / 180)
    assert (six["p95_ms"][-2], six["p99_ms"][-2]) == (90, 200)


def test_replicas_over_time_come_from_the_replicas_own_times(tenant):
    endpoint = deploy(tenant)
    base = NOW.replace(second=0)
    ago = lambda minutes: base - timedelta(minutes=minutes)  # noqa: E731
    replica(endpoint, 20001, created=ago(10) + timedelta(seconds=5), ready=ago(9), stopped=ago(3))
    replica(endpoint, 20002, created=ago(6), ready=ago(5) + timedelta(seconds=30), drained=ago(1), stopped=ago(0))
    replica(endpoint, 20003, created=ago(90), ready=ago(89), stopped=ago(80))  # before the window
    with scopes_disabled():
        series = metrics.traffic_series(endpoint, window=metrics.window_named("1h"), now=NOW)
    # The most at any moment of each minute (12:19 ... 12:30): a replica ending as a minute starts is not in it.
    assert series["replicas"][-12:] == [0, 1, 1, 1, 1, 2, 2, 2, 1, 1, 1, 0]
    assert series["replicas_ready"][-12:] == [0, 0, 1, 1, 1, 1, 2, 2, 1, 1, 0, 0]


def test_cost_by_day_sums_only_this_endpoints_replicas(tenant):
    endpoint, other = deploy(tenant), deploy(tenant, "other")
    node = Node.objects.create(name="n", state=Node.State.UP, token_hash="x", backend="sim")
    now = timezone.now()
    day_ms = 86_400_000
    today = int(now.timestamp() * 1000) // day_ms * day_ms
    mine = replica(endpoint, 20001, created=now)
    theirs = replica(other, 20002, created=now)
    with scopes_disabled():
        for seq, (r, start, amount) in enumerate(
            [(mine, today + 1000, "0.5"), (mine, today - day_ms + 5, "0.25"), (theirs, today + 2000, "9")]
        ):
            UsageWindow.objects.create(
                tenant=tenant, job=r.job, node=node, seq=seq, start_ms=start, end_ms=start + 1000,
                gpu_model="L4-24GB", mode="shared", gpu_ms=250, amount=Decimal(amount),
            )  # fmt: skip
    with scopes_disabled():
        days = metrics.cost_by_day(endpoint, days=3)
    assert [d["amount"] for d in days] == [Decimal(0), Decimal("0.25"), Decimal("0.5")]
    assert days[-1]["date"] == now.date() and days[-1]["gpu_ms"] == 250


def test_an_unknown_window_names_the_known_ones():
    with pytest.raises(ValueError, match="window must be one of 1h, 6h, 24h, 7d"):
        metrics.window_named("2h")


# --- the API ---------------------------------------------------------------------------------


def test_metrics_api_returns_the_series_and_refuses_bad_parameters(tenant, api_client_for):
    endpoint = deploy(tenant)
    report(endpoint, minute(timezone.now(), 9, p50=5, p95=8, p99=9))
    client = api_client_for(tenant)
    url = f"/api/v1/endpoints/{endpoint.pk}/metrics/"
    body = client.get(url, {"window": "24h", "days": "7"}).json()
    assert body["series"]["window"] == "24h" and sum(body["series"]["requests"]) == 9
    assert len(body["cost_by_day"]) == 7 and body["cost_by_day"][-1]["cost"] == "0"
    bad = client.get(url, {"window": "2h"})
    assert bad.status_code == 400 and "1h, 6h, 24h, 7d" in bad.json()["error"]["fields"]["window"][0]
    bad = client.get(url, {"days": "0"})
    assert bad.status_code == 400 and bad.json()["error"]["fields"]["days"] == [
        "days must be a whole number from 1 to 90"
    ]


def test_another_tenants_endpoint_metrics_are_404(tenant, api_client_for):
    endpoint = deploy(TenantFactory(slug="rival"))
    assert api_client_for(tenant).get(f"/api/v1/endpoints/{endpoint.pk}/metrics/").status_code == 404
