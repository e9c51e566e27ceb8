"""Reports from the billing ledger: utilisation, idle and out-of-service capacity, revenue per GPU model
and node, top tenants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.urls import reverse
from django.utils import timezone

from agents.models import GpuOutage, Node
from billing.models import Charge, UsageWindow
from scheduler.models import Allocation
from scheduler.services import schedule_pass
from tests.console.test_queue import queued_job

HOUR_MS = 3_600_000


def last_month() -> tuple[datetime, datetime]:
    this = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start = (this - timedelta(days=1)).replace(day=1)
    return start.astimezone(UTC), this.astimezone(UTC)


def test_report_reads_the_ledger_per_model_node_and_tenant(staff_client, fleet, tenant, other_tenant, rules):
    start, end = last_month()
    start_ms, hours = int(start.timestamp() * 1000), (end - start).total_seconds() / 3600
    Node.objects.update(registered_at=start)
    for owner, node, model, held_h, amount in (
        (tenant, fleet[0], "H100-80GB", 2, "4.98"),
        (other_tenant, fleet[1], "L4-24GB", 1, "0.70"),
    ):
        for other in fleet:
            other.state = Node.State.UP if other == node else Node.State.CORDONED
            other.save(update_fields=["state"])
        job = queued_job(owner)
        schedule_pass()
        allocation = Allocation.objects.get(job=job)
        Allocation.objects.filter(pk=allocation.pk).update(
            created_at=start, released_at=start + timedelta(hours=held_h)
        )
        window = UsageWindow.objects.create(
            tenant=owner,
            job=job,
            node=node,
            attempt=1,
            seq=0,
            start_ms=start_ms,
            end_ms=start_ms + held_h * HOUR_MS,
            gpu_model=model,
            mode="dedicated",
            gpu_ms=held_h * HOUR_MS,
            amount=Decimal(amount),
        )
        Charge.objects.create(
            tenant=owner,
            window=window,
            job=job,
            month=start.date(),
            start_ms=window.start_ms,
            end_ms=window.end_ms,
            gpu_model=model,
            mode="dedicated",
            priority_class="standard",
            rate_per_gpu_hour=Decimal(1),
            gpu_ms=window.gpu_ms,
            amount=Decimal(amount),
        )
    out = fleet[1].gpus.get(index=1)
    GpuOutage.objects.create(gpu=out, started_at=start, ended_at=start + timedelta(hours=10), reason="XID 79")

    response = staff_client.get(reverse("console:reports"), {"month": f"{start:%Y-%m}"})
    report = response.context["report"]
    assert report.problems == []
    by_model = {line.name: line for line in report.by_model}
    h100, l4 = by_model["H100-80GB"], by_model["L4-24GB"]
    assert (h100.gpus, h100.held_gpu_hours, h100.revenue) == (2, 2.0, Decimal("4.98"))
    assert abs(h100.available_gpu_hours - 2 * hours) < 1e-6
    assert abs(h100.idle_gpu_hours - (2 * hours - 2)) < 1e-6
    assert l4.out_of_service_gpu_hours == 10.0 and abs(l4.available_gpu_hours - (2 * hours - 10)) < 1e-6
    by_node = {line.name: line for line in report.by_node}
    assert by_node["node-b"].held_gpu_hours == 1.0 and by_node["node-b"].revenue == Decimal("0.70")
    assert [(t.name, t.revenue) for t in report.top_tenants] == [
        (tenant.slug, Decimal("4.98")),
        (other_tenant.slug, Decimal("0.70")),
    ]
    assert report.total.revenue == Decimal("5.68")
    assert 'id="by-node"' in response.content.decode()


def test_bad_month_is_refused_with_the_rule(staff_client):
    response = staff_client.get(reverse("console:reports"), {"month": "March"}, follow=True)
    assert b"Month must look like YYYY-MM" in response.content


def test_empty_month_renders(staff_client, fleet):
    last_year = (timezone.now() - timedelta(days=400)).strftime("%Y-%m")
    response = staff_client.get(reverse("console:reports"), {"month": last_year})
    assert response.status_code == 200
    assert response.context["report"].total.held_gpu_hours == 0
