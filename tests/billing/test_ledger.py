"""The ledger on a simulated month: preemption, slices, a node outage, mid-month registration; and failures."""

from __future__ import annotations

import io
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django_scopes import scopes_disabled

from agents.models import GpuOutage
from billing.ledger import Held, gpu_ledger
from billing.models import Charge, UsageWindow
from billing.selectors import ledger_month
from billing.services import usage_windows_ingest
from scheduler.models import Allocation, Job
from tests.billing.conftest import dt, ms, window
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

FEB = date(2026, 2, 1)
H = 3_600_000
TEN_MIN = 600_000


def run(node, job, start, end, *, attempt=1, seq0=0, step=TEN_MIN):
    """Ingest contiguous windows for ``job`` over [start, end)."""
    windows = [
        window(job, seq0 + i, t, min(t + step, end), attempt=attempt) for i, t in enumerate(range(start, end, step))
    ]
    result = usage_windows_ingest(node=node, windows=windows)
    assert result["rejected"] == 0
    return result


@pytest.fixture
def february(fleet, tenant, other_tenant):
    """node-a registers on Feb 10 with one H100 and one L4.

    Feb 11: job A (preemptible) holds the H100 00-01h, is preempted by job B (01-02h), requeued and runs
    again 02-03h as attempt 2. Two tenants' half slices share the L4 00-02h. Feb 20: node down 00-06h.
    """
    node = fleet.node("node-a", gpus=("H100-80GB", "L4-24GB"))
    node.registered_at = dt(2026, 2, 10)
    node.save()
    day = dt(2026, 2, 11)
    a = fleet.job(tenant, node=node, priority="preemptible", at=day, released=day + timedelta(hours=1))
    b = fleet.job(other_tenant, node=node, at=day + timedelta(hours=1), released=day + timedelta(hours=2))
    h100 = node.gpus.get(index=0)
    with scopes_disabled():
        Job.objects.filter(pk=a.pk).update(attempt=2)  # preempted and requeued once
        a.refresh_from_db()
        second = Allocation.objects.create(tenant=tenant, job=a, gpu=h100, share_milli=1000)
        Allocation.objects.filter(pk=second.pk).update(
            created_at=day + timedelta(hours=2), released_at=day + timedelta(hours=3)
        )
    s1 = fleet.job(tenant, node=node, model="L4-24GB", gpu_milli=500, at=day, released=day + timedelta(hours=2))
    s2 = fleet.job(other_tenant, node=node, model="L4-24GB", gpu_milli=500, at=day, released=day + timedelta(hours=2))
    t0 = ms(2026, 2, 11)
    run(node, a, t0, t0 + H)
    run(node, b, t0 + H, t0 + 2 * H)
    run(node, a, t0 + 2 * H, t0 + 3 * H, attempt=2)
    run(node, s1, t0, t0 + 2 * H)
    run(node, s2, t0, t0 + 2 * H, step=7 * 60_000)
    for gpu in node.gpus.all():
        GpuOutage.objects.create(gpu=gpu, started_at=dt(2026, 2, 20), ended_at=dt(2026, 2, 20, 6), reason="node down")
    return node, {"a": a, "b": b, "s1": s1, "s2": s2}


def test_every_second_of_the_month_is_accounted_for(february):
    with scopes_disabled():
        report = ledger_month(month=FEB)
        revenue = sum(Charge.objects.filter(month=FEB).values_list("amount", flat=True))

    assert report.problems == []
    h100, l4 = report.gpus
    in_service = (ms(2026, 3, 1) - ms(2026, 2, 10)) * 1000  # from registration, in milli-GPU-ms
    for gpu in (h100, l4):
        assert gpu.capacity == in_service
        assert gpu.out_of_service == 6 * H * 1000
        assert gpu.held + gpu.idle + gpu.out_of_service == gpu.capacity
    assert h100.held == 3 * H * 1000  # A 1 h, B 1 h, A again 1 h
    assert l4.held == 2 * H * 1000  # two half slices for 2 h
    assert sum(g.revenue for g in report.gpus) == revenue
    by_model = {r.key: r for r in report.by_model}
    assert by_model["H100-80GB"].utilisation == (Decimal(3 * H * 1000) / (in_service - 6 * H * 1000)).quantize(
        Decimal("0.0001")
    )
    assert [r.key for r in report.by_node] == ["node-a"]


def test_ledger_check_command_passes_then_fails_loudly(february):
    node, jobs = february
    out = io.StringIO()
    call_command("ledger_check", "--month", "2026-02", stdout=out)
    assert "ledger check passed: 2 GPU(s)" in out.getvalue()
    assert "H100-80GB" in out.getvalue() and "node-a" in out.getvalue()

    # A lost window (a gap) and an outage that overlaps billed time.
    with scopes_disabled():
        UsageWindow.objects.filter(job=jobs["b"], seq=3).delete()
    GpuOutage.objects.create(
        gpu=node.gpus.get(index=1), started_at=dt(2026, 2, 11, 1), ended_at=dt(2026, 2, 11, 1, 30), reason="xid 79"
    )
    err = io.StringIO()
    with pytest.raises(CommandError, match="ledger check FAILED for 2026-02"):
        call_command("ledger_check", "--month", "2026-02", stdout=io.StringIO(), stderr=err)
    assert f"gap: job {jobs['b'].pk} attempt 1 unmetered for 600000 ms" in err.getvalue()
    assert "billed while out of service" in err.getvalue()


def test_double_held_gpu_is_an_overlap(february, fleet, tenant):
    node, _ = february
    day = dt(2026, 2, 11)
    intruder = fleet.job(tenant, node=node, gpu_indexes=[0], at=day, released=day + timedelta(hours=1))
    run(node, intruder, ms(2026, 2, 11), ms(2026, 2, 11) + TEN_MIN)
    with scopes_disabled():
        report = ledger_month(month=FEB)
    assert any("held 2x" in p for p in report.problems)


def test_unattributed_charge_is_reported(february):
    _, jobs = february
    with scopes_disabled():
        Allocation.objects.filter(job=jobs["b"]).delete()
        report = ledger_month(month=FEB)
    assert any(p.startswith(f"unattributed: job {jobs['b'].pk}") for p in report.problems)


def test_pure_ledger_counts_overlapping_outages_once():
    ledger = gpu_ledger(
        gpu_id=1, node="n", model="m", start_ms=0, end_ms=100, held=[Held(0, 10, 500, 7)], outages=[(50, 80), (60, 90)]
    )
    assert (ledger.capacity, ledger.held, ledger.out_of_service, ledger.idle) == (100_000, 5_000, 40_000, 55_000)
    assert ledger.problems == []


def test_ledger_page_is_staff_only(february):
    client = Client()
    client.force_login(UserFactory())
    assert client.get("/billing/ledger/?month=2026-02").status_code == 302  # to the admin login
    client.force_login(UserFactory(is_staff=True))
    page = client.get("/billing/ledger/?month=2026-02")
    assert page.status_code == 200
    assert b"Balanced" in page.content and b"node-a" in page.content
    assert client.get("/billing/ledger/?month=Feb").status_code == 400
