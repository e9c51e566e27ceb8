"""Ingest on PostgreSQL: idempotent, out of order, rejects bad windows, splits at price changes."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from billing.models import Charge, ChargeBatch, TenantDiscount, UsageWindow
from billing.services import usage_windows_ingest
from scheduler.models import Job
from tests.billing.conftest import dt, ms, price_set, window

pytestmark = pytest.mark.django_db

T0 = ms(2026, 3, 10, 12)


def cost(job) -> Decimal:
    with scopes_disabled():
        return Job.objects.get(pk=job.pk).cost


def test_same_window_twice_is_stored_and_billed_once(fleet, tenant):
    node = fleet.node()
    job = fleet.job(tenant, node=node)
    w = window(job, 0, T0, T0 + 60_000, sm_util_ms=30_000)

    first = usage_windows_ingest(node=node, windows=[w, dict(w)])
    second = usage_windows_ingest(node=node, windows=[w])

    assert first == {"stored": 1, "rejected": 0, "replayed": 1}
    assert second == {"stored": 0, "rejected": 0, "replayed": 1}
    with scopes_disabled():
        assert UsageWindow.objects.count() == 1
        assert Charge.objects.count() == 1
    assert cost(job) == Decimal("0.0415000000")  # 60 GPU-s at 2.49/h


def test_out_of_order_windows_are_all_stored(fleet, tenant):
    node = fleet.node()
    job = fleet.job(tenant, node=node)
    windows = [window(job, seq, T0 + seq * 1000, T0 + (seq + 1) * 1000) for seq in range(5)]

    usage_windows_ingest(node=node, windows=[windows[3], windows[1]])
    usage_windows_ingest(node=node, windows=[windows[4], windows[0], windows[2], windows[3]])

    with scopes_disabled():
        assert list(UsageWindow.objects.filter(job=job).order_by("seq").values_list("seq", flat=True)) == [
            0,
            1,
            2,
            3,
            4,
        ]
        assert Job.objects.get(pk=job.pk).gpu_ms == 5000


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"start_ms": T0 + 500, "end_ms": T0 + 1500}, "overlap"),
        ({"start_ms": T0 + 5000, "end_ms": T0 + 5000}, "empty"),
        ({"start_ms": T0, "end_ms": T0 + 16 * 60_000}, "too long"),
        ({"sm_util_ms": 5_000}, "sm above wall time"),
        ({"energy_mj": 10**12}, "energy"),
        ({"memory_peak_mb": 10**9}, "memory"),
        ({"start_ms": "yesterday"}, "type"),
        ({"seq": -1}, "negative"),
        ({"attempt": 2}, "attempt never launched"),
        ({"attempt": 0}, "attempt zero"),
    ],
)
def test_impossible_or_overlapping_windows_are_rejected_not_billed(fleet, tenant, bad, why):
    node = fleet.node()
    job = fleet.job(tenant, node=node)
    usage_windows_ingest(node=node, windows=[window(job, 0, T0, T0 + 1000)])
    before = cost(job)

    result = usage_windows_ingest(node=node, windows=[{**window(job, 1, T0 + 2000, T0 + 3000), **bad}])

    assert result["rejected"] == 1, why
    assert cost(job) == before
    with scopes_disabled():
        assert UsageWindow.objects.count() == 1


def test_unknown_job_and_foreign_node_are_rejected(fleet, tenant):
    node, other = fleet.node("node-a"), fleet.node("node-b")
    job = fleet.job(tenant, node=node)

    result = usage_windows_ingest(
        node=other, windows=[window(job, 0, T0, T0 + 1000), {**window(job, 1, T0, T0 + 1000), "job_id": 999_999}]
    )

    assert result == {"stored": 0, "rejected": 2, "replayed": 0}
    assert cost(job) == 0
    assert usage_windows_ingest(node=node, windows=["junk", None, window(job, 0, T0, T0 + 1000)]) == {
        "stored": 1,
        "rejected": 2,
        "replayed": 0,
    }


def test_a_price_change_never_rewrites_past_usage(fleet, tenant):
    node = fleet.node()
    job = fleet.job(tenant, node=node, gpu_milli=2000)
    usage_windows_ingest(node=node, windows=[window(job, 0, T0 - 60_000, T0)])
    price_set("H100-80GB", "dedicated", "3.60", dt(2026, 3, 10, 12))

    # A late window from before the change, and one straddling it.
    usage_windows_ingest(node=node, windows=[window(job, 2, T0 + 60_000, T0 + 120_000)])
    usage_windows_ingest(node=node, windows=[window(job, 1, T0 - 1000, T0 + 1000)])  # overlaps seq 0: rejected
    usage_windows_ingest(node=node, windows=[window(job, 3, T0 - 120_000, T0 - 60_000)])

    with scopes_disabled():
        amounts = dict(UsageWindow.objects.filter(job=job).values_list("seq", "amount"))
    assert amounts == {
        0: Decimal("0.0830000000"),  # 120 GPU-s at 2.49, unchanged by the later price
        2: Decimal("0.1200000000"),  # at 3.60
        3: Decimal("0.0830000000"),  # late, but before the change: 2.49
    }


def test_shared_window_over_month_boundary_becomes_two_charges(fleet, tenant):
    node = fleet.node()
    job = fleet.job(tenant, node=node, gpu_milli=500, priority="preemptible")
    TenantDiscount.objects.create(tenant=tenant, percent=Decimal("20"), effective_from=dt(2026, 4, 1))
    midnight = ms(2026, 4, 1)

    usage_windows_ingest(node=node, windows=[window(job, 0, midnight - 60_000, midnight + 60_000)])

    with scopes_disabled():
        charges = list(Charge.objects.filter(job=job).order_by("start_ms"))
    assert [c.month for c in charges] == [date(2026, 3, 1), date(2026, 4, 1)]
    assert [c.gpu_ms for c in charges] == [30_000, 30_000]
    # 2.99 × 0.6 (preemptible), then × 0.8 (discount from April)
    assert [c.rate_per_gpu_hour for c in charges] == [Decimal("1.794"), Decimal("1.4352")]
    assert [c.priority_class for c in charges] == ["preemptible", "preemptible"]


def test_ingest_query_count_does_not_grow_with_the_batch(fleet, tenant):
    node = fleet.node()
    jobs = [fleet.job(tenant, node=node, gpu_milli=125) for _ in range(4)]
    small = [window(j, 0, T0, T0 + 1000) for j in jobs]
    big = [window(j, s, T0 + s * 1000, T0 + (s + 1) * 1000) for j in jobs for s in range(1, 300)]

    with CaptureQueriesContext(connection) as q_small:
        usage_windows_ingest(node=node, windows=small)
    with CaptureQueriesContext(connection) as q_big:
        result = usage_windows_ingest(node=node, windows=big)

    assert result["stored"] == len(big)
    assert len(q_big) == len(q_small)


def test_each_charge_is_in_a_batch_of_its_tenant_and_month(fleet, tenant, other_tenant):
    node = fleet.node()
    mine = fleet.job(tenant, node=node, gpu_indexes=[0])
    theirs = fleet.job(other_tenant, node=node, gpu_indexes=[1])
    midnight = ms(2026, 4, 1)
    windows = [window(mine, 0, midnight - 60_000, midnight + 60_000), window(theirs, 0, T0, T0 + 60_000)]

    usage_windows_ingest(node=node, windows=windows)

    with scopes_disabled():
        charges = list(Charge.objects.select_related("batch"))
        batches = set(ChargeBatch.objects.values_list("tenant_id", "month"))
    assert len(charges) == 3
    assert all((c.batch.tenant_id, c.batch.month) == (c.tenant_id, c.month) for c in charges)
    assert batches == {
        (tenant.pk, date(2026, 3, 1)),
        (tenant.pk, date(2026, 4, 1)),
        (other_tenant.pk, date(2026, 3, 1)),
    }


def test_text_is_stored_exactly_whatever_it_contains(fleet, tenant):
    """Windows and charges go in with COPY: tabs, newlines and backslashes must survive its text format."""
    odd = "H100\\80GB\tPCIe\nrev\\N"
    node = fleet.node(gpus=(odd,))
    job = fleet.job(tenant, node=node, model=odd)
    price_set(odd, "dedicated", "1.00", dt(2026, 1, 1))

    usage_windows_ingest(node=node, windows=[window(job, 0, T0, T0 + 3_600_000 // 4)])

    with scopes_disabled():
        stored = UsageWindow.objects.get(job=job)
        charge = Charge.objects.get(job=job)
    assert stored.gpu_model == charge.gpu_model == odd
    assert charge.amount == stored.amount == Decimal("0.2500000000")


def test_a_replay_is_found_however_long_the_job_has_run(fleet, tenant):
    node = fleet.node()
    job = fleet.job(tenant, node=node)
    hour = [window(job, seq, T0 + seq * 60_000, T0 + (seq + 1) * 60_000) for seq in range(120)]
    usage_windows_ingest(node=node, windows=hour)

    result = usage_windows_ingest(node=node, windows=[hour[3], window(job, 120, T0 + 7_200_000, T0 + 7_260_000)])

    assert result == {"stored": 1, "rejected": 0, "replayed": 1}
    with scopes_disabled():
        assert UsageWindow.objects.filter(job=job).count() == 121
