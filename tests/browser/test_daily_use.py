"""Daily use in a real browser: the phone-width menu, endpoints created, scaled and deleted from
the portal, webhooks with their deliveries, money on hover, and a running job's live samples."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from endpoints.models import Endpoint
from scheduler.models import Allocation, Job, JobState
from scheduler.services import JobSpec, job_submit
from tests.browser.test_portal_flow import PASSWORD, owner_of
from webhooks.models import Delivery

pytestmark = [pytest.mark.browser]
PHONE = (375, 812)


def test_the_phone_menu_opens_and_closes_and_nothing_overflows(live_server, rules, page_for, screenshot):
    tenant, owner = owner_of("phonecorp")
    phone = page_for(owner, password=PASSWORD, viewport=PHONE)
    phone.goto("/")
    toggle = phone.locator("[data-nav-toggle]")
    assert toggle.is_visible() and toggle.get_attribute("aria-expanded") == "false"
    assert not phone.locator("nav.mainnav").is_visible()  # folded away behind the button
    for path in ("/", "/jobs/", "/endpoints/", "/endpoints/new/", "/webhooks/", "/usage/", "/team/"):
        phone.goto(path)
        assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
    phone.goto("/")
    toggle.click()
    assert toggle.get_attribute("aria-expanded") == "true"
    links = phone.locator("nav.mainnav a")
    assert links.first.is_visible() and links.count() >= 7
    box = phone.locator("nav.mainnav").bounding_box()
    assert box["width"] <= PHONE[0]  # stacked, inside the screen
    screenshot(phone, "30-phone-menu-open")
    phone.locator("nav.mainnav a", has_text="Endpoints").click()
    phone.wait_for_url("**/endpoints/")
    assert not phone.locator("nav.mainnav").is_visible()  # a new page starts folded
    # On a desktop there is no button: the links are there.
    desk = page_for(owner, password=PASSWORD)
    desk.goto("/")
    assert not desk.locator("[data-nav-toggle]").is_visible() and desk.locator("nav.mainnav a").first.is_visible()


def test_an_endpoint_is_created_scaled_and_deleted_from_the_portal(live_server, rules, page_for, screenshot):
    tenant, owner = owner_of("servers")
    page = page_for(owner, password=PASSWORD, viewport=PHONE)
    page.goto("/endpoints/")
    page.locator("#endpoint-new").click()
    page.fill("#id_name", "llm")
    page.fill("#id_command", "python serve.py")
    page.select_option("#id_gpus", "0.5")
    page.fill("#id_max_replicas", "0")  # refused by the API's rules, shown on the field
    page.locator("#endpoint-form [type=submit]").click()
    assert "greater than or equal to 1" in page.locator("#err-max_replicas").inner_text()
    page.fill("#id_max_replicas", "2")
    page.locator("#endpoint-form [type=submit]").click()
    page.wait_for_selector("#scale-form")
    with scopes_disabled():
        endpoint = Endpoint.objects.get(tenant=tenant, name="llm")
    assert (endpoint.gpu_milli, endpoint.max_replicas) == (500, 2)
    screenshot(page, "31-endpoint-created-phone")
    page.fill("#scale-max", "4")
    page.locator("#scale-form [type=submit]").click()
    page.wait_for_selector(".flash")
    assert "between 0 and 4 replicas" in page.locator(".flash").inner_text()
    page.on("dialog", lambda dialog: dialog.accept())  # the delete button asks first
    page.locator("#endpoint-delete").click()
    page.wait_for_url("**/endpoints/")
    with scopes_disabled():
        assert Endpoint.objects.get(pk=endpoint.pk).state == Endpoint.State.DELETED


def test_a_webhook_is_added_and_its_deliveries_shown(live_server, rules, page_for, screenshot, settings):
    settings.GPUSHARE = {**settings.GPUSHARE, "WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    tenant, owner = owner_of("hooked")
    page = page_for(owner, password=PASSWORD)
    page.goto("/")
    page.locator("nav.mainnav a", has_text="Webhooks").click()
    page.fill("#id_url", "http://127.0.0.1:9/hooks")
    page.locator("#webhook-form input[value='job.*']").check()
    page.locator("#webhook-form [type=submit]").click()
    page.wait_for_selector("#webhook-secret")
    assert page.locator("#webhook-secret").inner_text().startswith("whsec_")
    page.locator("#ping").click()
    page.wait_for_selector("#deliveries tr[data-delivery]")
    with scopes_disabled():
        delivery = Delivery.objects.get(tenant=tenant)
    assert "ping" in page.locator(f'tr[data-delivery="{delivery.pk}"]').inner_text()
    screenshot(page, "32-webhook")


def test_money_hover_and_a_running_jobs_live_samples(live_server, rules, page_for, screenshot):
    tenant, owner = owner_of("livewire")
    node = Node.objects.create(name="node-live", state=Node.State.UP, token_hash="x", backend="sim")
    gpu = Gpu.objects.create(node=node, uuid="GPU-live-0", index=0, model="H100-80GB", memory_mb=81920)
    with scopes_disabled():
        job = job_submit(tenant=tenant, user=owner, spec=JobSpec(kind="training", gpu_milli=1000, command=["x"]))
        Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=job.pk).update(
            state=JobState.RUNNING, node=node, started_at=timezone.now(), cost="0.0123456789"
        )

    def heartbeat(sm: float, memory: int) -> None:
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now())
        metrics = {"util": sm, "power_w": 300.0, "jobs": {str(job.pk): {"sm_util": sm, "memory_mb": memory}}}
        Gpu.objects.filter(pk=gpu.pk).update(last_metrics=metrics)

    page = page_for(owner, password=PASSWORD)
    heartbeat(40.0, 1000)
    page.goto(f"/jobs/{job.pk}/")
    page.wait_for_selector('#job-metrics[data-live="1"]')  # no metering window yet, a live point already
    heartbeat(75.0, 2000)
    page.wait_for_selector('#job-metrics[data-live="2"]', timeout=15_000)
    drawn = page.evaluate("Chart.getChart(document.querySelector('[data-series=sm]')).data.datasets[0].data")
    assert drawn == [40, 75]
    cost = page.locator("#cost-so-far")
    assert cost.inner_text().strip() == "$0.01" and "$0.0123456789" in (
        cost.get_attribute("title") or cost.locator(".money").get_attribute("title")
    )
    screenshot(page, "33-job-live-samples")
    assert get_user_model().objects.filter(pk=owner.pk).exists()
