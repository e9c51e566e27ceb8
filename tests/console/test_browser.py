"""The console in headless Chromium (Debian's binary via Playwright): editing a rule with its
preview, the fleet grid with live refresh, and a drain. Screenshots: artifacts/screenshots/console-*.png."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents.models import Gpu, Node
from scheduler.models import Job, PriorityClass
from scheduler.services import schedule_pass
from tests.console.conftest import node_with_gpus
from tests.console.test_queue import queued_job
from tests.console.test_whatif_replay import HISTORY, run_real_scheduler
from tests.factories import TenantFactory, platform_rules_seed

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
PASSWORD = "operator-browser-pass"


@pytest.fixture
def operator_page(browser, live_server, transactional_db):
    get_user_model().objects.create_user("ops@example.test", password=PASSWORD, is_staff=True, is_superuser=True)
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1360, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.goto("/admin/login/?next=/console/")
    page.fill("input[name=username]", "ops@example.test")
    page.fill("input[name=password]", PASSWORD)
    page.locator("input[type=submit]").click()
    page.wait_for_url("**/console/fleet/")
    yield page
    context.close()


def test_edit_a_rule_with_its_preview_then_save(operator_page, screenshot):
    platform_rules_seed()
    node_with_gpus("solo", ("H100-80GB", "H100-80GB"))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    PriorityClass.objects.get(name="standard").may_preempt.clear()
    run_real_scheduler(HISTORY, start=timezone.now() - timedelta(hours=3), tenants=tenants)
    page = operator_page

    page.goto("/console/rules/")
    row = page.locator('tr[data-class="preemptible"]')
    row.locator("input[name$='-rank']").fill("250")
    page.fill("input[name=hours]", "6")
    page.locator("input[name=_preview]").click()
    page.wait_for_selector("#preview-table")
    alpha_after = page.locator('#preview-table tr[data-group="tenant"][data-name="alpha"] [data-testid=mean-after]')
    assert "better" in alpha_after.get_attribute("class")
    assert "preemptible" in page.locator("#changes").inner_text()
    screenshot(page, "console-rules-preview")
    assert PriorityClass.objects.get(name="preemptible").rank == 100  # a preview saves nothing

    # A contradiction is refused with its reason, and nothing is saved.
    page.locator('tr[data-class="standard"] select[name$="-may_preempt"]').select_option(label="serving")
    page.locator("input[name=_save]").click()
    page.wait_for_selector("#rule-problems")
    assert "serving is not preemptible" in page.locator("#rule-problems").inner_text()
    screenshot(page, "console-rules-contradiction")

    page.locator('tr[data-class="standard"] select[name$="-may_preempt"]').select_option([])
    page.locator("input[name=_save]").click()
    page.wait_for_selector(".messagelist .success")
    assert PriorityClass.objects.get(name="preemptible").rank == 250
    assert AuditLog.objects.filter(action="priority_class.update", target="preemptible").exists()


def test_fleet_grid_refreshes_and_a_drain_takes_effect(operator_page, screenshot):
    platform_rules_seed()
    node_a = node_with_gpus("node-a")
    node_with_gpus("node-b", ("L4-24GB",) * 2)
    tenant = TenantFactory(slug="acme")
    job = queued_job(tenant)
    schedule_pass()
    with scopes_disabled():
        job.refresh_from_db()
    Gpu.objects.filter(uuid="GPU-node-b-1").update(health=Gpu.Health.OUT_OF_SERVICE, health_reason="XID 48: ECC")
    page = operator_page

    page.goto("/console/fleet/")
    held = page.locator(f'article.gpu[data-state="dedicated"]:has-text("job {job.pk}")')
    assert held.count() == 1 and "acme" in held.inner_text()
    assert "XID 48: ECC" in page.locator('article[data-gpu="GPU-node-b-1"]').inner_text()

    # Live refresh: new metrics show up without a reload.
    Gpu.objects.filter(node__name="node-b", index=0).update(last_metrics={"util": 87.5, "temperature_c": 66})
    page.wait_for_selector('article[data-gpu="GPU-node-b-0"]:has-text("util 87.5%")', timeout=30_000)
    screenshot(page, "console-fleet")

    node = page.locator(f"#node-{job.node.name}")
    node.locator("button:has-text('Drain')").click()
    page.wait_for_selector(f"#node-{job.node.name} [data-testid=node-state]:has-text('draining')")
    screenshot(page, "console-fleet-drain")
    node_a.refresh_from_db()
    assert Node.objects.get(name=job.node.name).state == Node.State.DRAINING
    assert AuditLog.objects.filter(action="node.drain", target=job.node.name).exists()

    # The drained node takes no new job.
    second = queued_job(tenant)
    schedule_pass()
    with scopes_disabled():
        second = Job.objects.select_related("node").get(pk=second.pk)
    assert second.node is None or second.node.name != job.node.name


def test_queue_change_class_and_cancel_in_the_browser(operator_page, screenshot):
    platform_rules_seed()
    tenant, other = TenantFactory(slug="acme"), TenantFactory(slug="globex")
    first = queued_job(other, priority="standard")
    moved = queued_job(tenant, priority="preemptible")
    doomed = queued_job(tenant, priority="preemptible")
    page = operator_page

    page.goto("/console/queue/")
    rows = page.locator("#queue tbody tr")
    assert [rows.nth(i).get_attribute("data-job") for i in range(3)] == [str(first.pk), str(moved.pk), str(doomed.pk)]
    screenshot(page, "console-queue")
    row = page.locator(f'tr[data-job="{moved.pk}"]')
    row.locator("select[name=priority]").select_option("serving")
    row.locator("button:has-text('Change class')").click()
    page.wait_for_selector(".messagelist .success")
    assert page.locator("#queue tbody tr").first.get_attribute("data-job") == str(moved.pk)
    page.locator(f'tr[data-job="{doomed.pk}"] button:has-text("Cancel")').click()
    page.wait_for_selector(f'.messagelist .success:has-text("Job {doomed.pk}")')
    assert page.locator(f'tr[data-job="{doomed.pk}"]').count() == 0
    with scopes_disabled():
        assert Job.objects.get(pk=doomed.pk).state == "cancelled"
    assert set(AuditLog.objects.values_list("action", flat=True)) >= {"job.priority_change", "job.cancel"}


def test_a_contradiction_in_the_admin_class_form(operator_page, screenshot):
    platform_rules_seed()
    page = operator_page
    preemptible = PriorityClass.objects.get(name="preemptible")
    page.goto(f"/admin/scheduler/priorityclass/{preemptible.pk}/change/")
    page.locator("select[name=default_for_kind]").select_option("training")
    page.locator("input[name=_save]").click()
    page.wait_for_selector(".errornote, .errorlist")
    assert "one default class per job kind: training has preemptible, standard" in page.content()
    screenshot(page, "console-admin-class-contradiction")
    assert PriorityClass.objects.get(name="preemptible").default_for_kind == ""
