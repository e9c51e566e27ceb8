"""The fleet grid, and cordon / drain / uncordon: audited, and followed by the scheduler."""

from __future__ import annotations

from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents.models import Gpu, Node
from scheduler.models import Job
from scheduler.services import schedule_pass
from tests.console.test_queue import queued_job


def test_grid_shows_each_gpu_its_holder_and_metrics(staff_client, fleet, tenant, rules):
    job = queued_job(tenant)
    schedule_pass()
    Gpu.objects.filter(uuid="GPU-node-b-1").update(
        health=Gpu.Health.OUT_OF_SERVICE, health_reason="XID 79: fell off the bus"
    )
    response = staff_client.get(reverse("console:fleet"))
    html = response.content.decode()
    with scopes_disabled():
        job.refresh_from_db()
    held = Gpu.objects.get(allocations__job=job)
    cells = {c.gpu.uuid: c for row in response.context["rows"] for c in row.gpus}
    assert cells[held.uuid].state == "dedicated"
    assert [(h.tenant, h.job_id, h.fraction, h.isolation) for h in cells[held.uuid].holders] == [
        (tenant.slug, job.pk, "whole", "exclusive")
    ]
    assert cells["GPU-node-b-1"].state == "out"
    assert "XID 79: fell off the bus" in html
    assert "util 42.0%" in html and "51 °C" in html
    assert response.context["summary"].gpus_out_of_service == 1


def test_htmx_refresh_returns_only_the_grid(staff_client, fleet):
    response = staff_client.get(reverse("console:fleet"), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert 'id="node-node-a"' in html and "<html" not in html


def test_cordon_is_audited_and_the_scheduler_places_nothing_there(staff_client, operator, fleet, tenant, rules):
    node_a, node_b = fleet
    response = staff_client.post(reverse("console:node-action", args=[node_a.pk, "cordon"]), {"reason": "firmware"})
    assert response.status_code == 302
    node_a.refresh_from_db()
    assert (node_a.state, node_a.state_reason) == (Node.State.CORDONED, "firmware")
    entry = AuditLog.objects.get(action="node.cordon")
    assert entry.actor == operator and entry.target == "node-a"
    assert entry.before["state"] == "up" and entry.after["state"] == "cordoned"

    jobs = [queued_job(tenant) for _ in range(3)]
    schedule_pass()
    with scopes_disabled():
        placed = {j.pk: j.node.name if j.node else None for j in Job.objects.filter(pk__in=[j.pk for j in jobs])}
    assert sorted(n for n in placed.values() if n) == ["node-b", "node-b"]  # two L4s; nothing on node-a
    assert list(placed.values()).count(None) == 1

    staff_client.post(reverse("console:node-action", args=[node_a.pk, "uncordon"]))
    schedule_pass()
    with scopes_disabled():
        assert Job.objects.filter(pk__in=[j.pk for j in jobs], node__name="node-a").count() == 1
    assert AuditLog.objects.filter(action="node.uncordon", target="node-a").count() == 1


def test_drain_keeps_running_jobs_takes_no_new_ones_and_an_empty_node_is_cordoned(staff_client, fleet, tenant, rules):
    node_a, node_b = fleet
    staff_client.post(reverse("console:node-action", args=[node_b.pk, "cordon"]))
    first = queued_job(tenant)
    schedule_pass()
    with scopes_disabled():
        first.refresh_from_db()
    assert first.node == node_a
    staff_client.post(reverse("console:node-action", args=[node_a.pk, "drain"]))
    node_a.refresh_from_db()
    assert node_a.state == Node.State.DRAINING  # a job still holds a GPU there
    second = queued_job(tenant)
    schedule_pass()
    with scopes_disabled():
        second.refresh_from_db()
        first.refresh_from_db()
    assert second.state == "queued" and second.node is None
    assert first.state == "scheduled" and first.node == node_a
    entry = AuditLog.objects.get(action="node.drain")
    assert entry.after["state"] == "draining"
    staff_client.post(reverse("console:node-action", args=[node_b.pk, "uncordon"]))
    staff_client.post(reverse("console:node-action", args=[node_b.pk, "drain"]))
    node_b.refresh_from_db()
    assert node_b.state == Node.State.CORDONED  # nothing ran there: drained at once


def test_refused_transition_says_why_and_writes_nothing(staff_client, fleet):
    node = fleet[0]
    Node.objects.filter(pk=node.pk).update(state=Node.State.DOWN)
    response = staff_client.post(reverse("console:node-action", args=[node.pk, "drain"]), follow=True)
    assert "Node node-a is down: only an up node can be drained" in response.content.decode()
    assert staff_client.post(reverse("console:node-action", args=[node.pk, "explode"])).status_code == 404
    assert staff_client.post(reverse("console:node-action", args=[99999, "cordon"])).status_code == 404
    assert not AuditLog.objects.exists()


def test_a_gpu_out_of_service_can_be_returned_audited_and_is_used_again(staff_client, operator, tenant, rules):
    from tests.console.conftest import node_with_gpus

    node = node_with_gpus("solo", ("H100-80GB",))
    gpu = node.gpus.get()
    Gpu.objects.filter(pk=gpu.pk).update(health=Gpu.Health.OUT_OF_SERVICE, health_reason="XID 79")
    job = queued_job(tenant)
    schedule_pass()
    with scopes_disabled():
        job.refresh_from_db()
    assert job.state == "queued"  # nothing in service to run on
    assert 'action="/console/fleet/gpus/' in staff_client.get(reverse("console:fleet")).content.decode()
    staff_client.post(reverse("console:gpu-return", args=[gpu.pk]), {"note": "reseated"})
    gpu.refresh_from_db()
    assert gpu.health == Gpu.Health.OK
    entry = AuditLog.objects.get(action="gpu.return_to_service")
    assert entry.actor == operator and entry.before["reason"] == "XID 79" and entry.after["note"] == "reseated"
    schedule_pass()
    with scopes_disabled():
        job.refresh_from_db()
    assert job.state == "scheduled" and job.node == node
    response = staff_client.post(reverse("console:gpu-return", args=[gpu.pk]), follow=True)
    assert "is in service already" in response.content.decode()
    assert AuditLog.objects.filter(action="gpu.return_to_service").count() == 1
