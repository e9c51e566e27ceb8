"""Reports: utilisation, idle capacity and revenue per GPU model and node, top tenants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.urls import reverse
from django.utils import timezone

from billing.models import Charge, UsageWindow
from tests.console.test_queue import queued_job

HOUR_MS = 3_600_000


def test_report_sums_windows_and_charges_per_model_node_and_tenant(staff_client, fleet, tenant, other_tenant, rules):
    now = timezone.now()
    month = now.date().replace(day=1)
    start_ms = int(datetime(month.year, month.month, 1, tzinfo=UTC).timestamp() * 1000)
    for owner, node, model, hours, amount in (
        (tenant, fleet[0], "H100-80GB", 2, "4.98"),
        (other_tenant, fleet[1], "L4-24GB", 1, "0.70"),
    ):
        job = queued_job(owner)
        window = UsageWindow.objects.create(
            tenant=owner, job=job, node=node, seq=0, start_ms=start_ms, end_ms=start_ms + hours * HOUR_MS,
            gpu_model=model, mode="dedicated", gpu_ms=hours * HOUR_MS, amount=Decimal(amount),
        )
        Charge.objects.create(
            tenant=owner, window=window, job=job, month=month, start_ms=window.start_ms, end_ms=window.end_ms,
            gpu_model=model, mode="dedicated", priority_class="standard", rate_per_gpu_hour=Decimal(1),
            gpu_ms=window.gpu_ms, amount=Decimal(amount),
        )
    response = staff_client.get(reverse("console:reports"), {"month": f"{now:%Y-%m}"})
    report = response.context["report"]
    by_model = {line.name: line for line in report.by_model}
    assert by_model["H100-80GB"].gpus == 2 and by_model["H100-80GB"].held_gpu_hours == 2.0
    assert by_model["H100-80GB"].revenue == Decimal("4.98")
    by_node = {line.name: line for line in report.by_node}
    assert by_node["node-b"].held_gpu_hours == 1.0 and by_node["node-b"].revenue == Decimal("0.70")
    hours_so_far = (now - datetime(month.year, month.month, 1, tzinfo=UTC)).total_seconds() / 3600
    assert abs(by_node["node-a"].available_gpu_hours - 2 * hours_so_far) < 0.01
    assert abs(by_node["node-a"].idle_gpu_hours - (2 * hours_so_far - 2)) < 0.01
    assert [t.name for t in report.top_tenants] == [tenant.slug, other_tenant.slug]
    assert report.total.revenue == Decimal("5.68")


def test_bad_month_is_refused_with_the_rule(staff_client):
    response = staff_client.get(reverse("console:reports"), {"month": "March"}, follow=True)
    assert b"Month must look like YYYY-MM" in response.content


def test_empty_month_renders(staff_client, fleet):
    last_year = (timezone.now() - timedelta(days=400)).strftime("%Y-%m")
    response = staff_client.get(reverse("console:reports"), {"month": last_year})
    assert response.status_code == 200
    assert response.context["report"].total.held_gpu_hours == 0
