"""The portal in a real browser against the real platform: live server, Celery
worker and a simulated node agent. Sign up (or be created) -> token -> submit
from the form -> watch it run and succeed without reloading -> log and chart ->
cost on the usage page; a viewer cannot submit; another tenant gets a 404."""

from __future__ import annotations

import re
import shlex
import sys
from decimal import Decimal

import pytest
import requests
from django_scopes import scopes_disabled

from accounts.models import Membership, Role
from accounts.services import tenant_create
from portal.templatetags.portal import money_exact, money_text
from scheduler.models import Job, JobState
from tests.factories import member_add

pytestmark = [pytest.mark.integration, pytest.mark.browser]

PASSWORD = "correct-horse-battery"
TRAIN = "import time\nfor i in range(6):\n    print(f'epoch {i} loss={1/(i+1):.3f}', flush=True)\n    time.sleep(1)"
GPUS_MESSAGE = "gpus must be a number: 1-8 whole GPUs, or 0.125, 0.25 or 0.5 for a shared slice"


def owner_of(slug: str):
    tenant = tenant_create(slug=slug, name=slug.title(), owner_email=f"eng@{slug}.test", owner_password=PASSWORD)
    with scopes_disabled():
        return tenant, Membership.objects.select_related("user").get(tenant=tenant).user


def sign_up(page, *, organisation: str, slug: str, email: str) -> None:
    """Through the accounts app's sign-up page."""
    page.goto("/accounts/signup/")
    page.fill("#id_organisation", organisation)
    page.fill("#id_slug", slug)
    page.fill("#id_email", email)
    page.fill("#id_password1", PASSWORD)
    page.fill("#id_password2", PASSWORD)
    page.locator("form [type=submit]").click()
    page.wait_for_url(lambda url: "/accounts/signup/" not in url)


def test_engineer_submits_from_the_form_and_watches_it_run(platform, agent_factory, page_for, screenshot):
    agent_factory("node-1")
    page = page_for(None)
    page.goto("/accounts/login/")
    screenshot(page, "00-login")
    page.goto("/accounts/signup/")
    screenshot(page, "00-signup")
    sign_up(page, organisation="Acme", slug="acme", email="eng@acme.test")
    with scopes_disabled():
        owner = Membership.objects.select_related("user", "tenant").get(user__username="eng@acme.test", role=Role.OWNER)
        tenant, owner = owner.tenant, owner.user

    page.goto("/")
    assert page.locator("h1").inner_text() == "Acme"
    screenshot(page, "01-dashboard-empty")

    # A token for CI: shown once, copyable, and it works against the API.
    page.goto("/team/")
    page.fill("#id_name", "github-actions")
    page.locator("#token-form [type=submit]").click()
    secret = page.locator("#new-token").inner_text().strip()
    assert secret.startswith("gps_")
    assert page.locator("#issued [data-copy]").is_visible()
    screenshot(page, "02-team-token-created")
    api = requests.get(f"{platform.url}/api/v1/jobs/", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert api.status_code == 200, api.text
    page.reload()
    assert secret not in page.content()  # shown once only
    assert "github-actions" in page.locator("#tokens").inner_text()

    # A second tab keeps the dashboard open: its live table follows the job by itself.
    dashboard = page_for(owner, password=PASSWORD)
    dashboard.goto("/")
    dashboard.evaluate("window.__sameDocument = true")
    dashboard.evaluate(
        """document.body.addEventListener('htmx:afterSettle', () => {
             const row = document.querySelector('#live-jobs tr[data-job]');
             if (row) window.__seen = row.innerText;
           })"""
    )

    # The submit form validates as you type, with the API's own message.
    page.goto("/jobs/new/")
    page.select_option("#id_kind", "training")
    page.fill("#id_gpus", "lots")
    page.locator("#err-gpus li").wait_for()
    assert page.locator("#err-gpus").inner_text().strip() == GPUS_MESSAGE
    page.fill("#id_gpus", "0.5")  # a slice, but training takes whole GPUs: the service's rule, shown live
    page.wait_for_function(
        "() => document.querySelector('#err-gpus').innerText.includes('training jobs take whole GPUs')"
    )
    page.fill("#id_name", "resnet-demo")
    page.fill("#id_gpus", "1")
    page.fill("#id_command", shlex.join([sys.executable, "-c", TRAIN]))
    page.wait_for_function("() => document.querySelector('#curl').innerText.includes('epoch')")
    assert page.locator("#err-gpus").inner_text().strip() == ""
    page.wait_for_function("() => document.querySelector('#estimate').innerText.includes('per hour')")
    assert "$0.70–$2.49" in page.locator("#estimate").inner_text()  # L4 to H100, one GPU
    assert '"gpus": 1' in page.locator("#curl").inner_text()
    screenshot(page, "03-submit-filled")
    page.locator("#submit-form [type=submit]").click()
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job_id = int(re.search(r"/jobs/(\d+)/", page.url).group(1))

    # The page updates itself: no reload between queued and succeeded.
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector("#job-live[data-state=running]", timeout=60_000)
    assert page.locator("#log-text").inner_text() == "" or "epoch" in page.locator("#log-text").inner_text()
    screenshot(page, "04-job-running")
    page.wait_for_selector("#job-live[data-state=succeeded]", timeout=90_000)
    page.wait_for_function("() => document.querySelector('#log-text').innerText.includes('epoch 5')", timeout=30_000)
    page.wait_for_function(
        "() => Number(document.querySelector('#job-metrics').dataset.count || 0) >= 3", timeout=30_000
    )
    assert page.evaluate("window.__sameDocument") is True
    log_text = page.locator("#log-text").inner_text()
    assert [f"epoch {i}" in log_text for i in range(6)] == [True] * 6
    timeline = page.locator(".timeline").inner_text()
    assert "queued" in timeline and "scheduled" in timeline and "running" in timeline and "succeeded" in timeline
    gpu_uuid = page.locator("dl.facts code").first.inner_text()
    assert gpu_uuid.startswith("GPU-")
    screenshot(page, "05-job-succeeded")

    with scopes_disabled():
        job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED and job.tenant_id == tenant.pk
    # The dashboard tab saw it (polling, no reload) and has dropped it now that it ended.
    dashboard.wait_for_function(
        f"() => !document.querySelector('#live-jobs tr[data-job=\"{job_id}\"]')", timeout=30_000
    )
    assert dashboard.evaluate("window.__sameDocument") is True
    assert dashboard.evaluate("window.__seen") is not None
    assert job.cost > 0

    # Its cost on the usage page, as metered.
    page.goto("/usage/")
    row = page.locator(f"#usage-by-job tr[data-job='{job_id}']")
    assert money_text(job.cost) in row.inner_text()
    assert page.locator("#usage-total").inner_text().strip() == money_text(job.cost)
    assert page.locator("#usage-total .money").get_attribute("title") == f"{money_exact(job.cost)} exact"
    page.wait_for_function("() => document.querySelector('canvas[data-usage-chart]').width > 0")
    assert page.evaluate("Chart.getChart(document.querySelector('canvas[data-model-chart]')).data.labels") == [
        f"{job.node.gpus.get(uuid=gpu_uuid).model} dedicated"
    ]
    screenshot(page, "06-usage")

    page.goto("/jobs/")
    assert "resnet-demo" in page.locator("table").inner_text()
    screenshot(page, "07-jobs-list")
    page.goto("/")
    screenshot(page, "08-dashboard")

    # A job too big for the fleet waits, and its page says why; it is cancelled from the page.
    big = requests.post(
        f"{platform.url}/api/v1/jobs/",
        json={"kind": "training", "gpus": 8, "command": ["true"], "name": "too-big"},
        headers={"Authorization": f"Bearer {secret}"},
        timeout=10,
    )
    assert big.status_code == 201, big.text
    big_id = big.json()["id"]
    page.goto(f"/jobs/{big_id}/")
    page.wait_for_function(
        "() => document.querySelector('#job-live').innerText.includes('Why pending:') && "
        "!document.querySelector('#job-live').innerText.includes('waiting for the next scheduling pass')",
        timeout=30_000,
    )
    assert "Position 1 in the queue" in page.locator("#job-live").inner_text()
    screenshot(page, "12-job-pending")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#cancel-job").click()
    page.wait_for_selector("#job-live[data-state=cancelled]")
    with scopes_disabled():
        assert Job.objects.get(pk=big_id).state == JobState.CANCELLED

    # Every form control has a label; the submit form works from the keyboard alone.
    for path in ("/", "/jobs/", "/jobs/new/", "/usage/", "/team/"):
        page.goto(path)
        unlabelled = page.evaluate(
            """[...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
                 .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')).map(e => e.name)"""
        )
        assert unlabelled == [], (path, unlabelled)
    page.goto("/jobs/new/")
    page.focus("#id_name")
    focused = []
    for _ in range(14):
        page.keyboard.press("Tab")
        focused.append(page.evaluate("document.activeElement.id || document.activeElement.innerText"))
    assert focused[:3] == ["id_kind", "id_gpus", "id_gpu_model"] and "Submit job" in focused

    # The layout holds on a phone: nothing wider than the screen.
    phone = page_for(owner, password=PASSWORD, viewport=(375, 812))
    for path in ("/", f"/jobs/{job_id}/", "/jobs/new/", "/jobs/", "/usage/", "/team/"):
        phone.goto(path)
        assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
    phone.goto(f"/jobs/{job_id}/")
    phone.wait_for_function("() => Number(document.querySelector('#job-metrics').dataset.count || 0) >= 3")
    screenshot(phone, "09-phone-job")
    phone.goto("/")
    screenshot(phone, "09-phone-dashboard")

    # A viewer sees the job but cannot submit.
    viewer = member_add(tenant, role=Role.VIEWER)
    viewer_page = page_for(viewer, password=PASSWORD)
    viewer_page.goto(f"/jobs/{job_id}/")
    assert "resnet-demo" in viewer_page.locator("h1").inner_text()
    viewer_page.goto("/jobs/new/")
    assert viewer_page.locator("#submit-form [type=submit]").is_disabled()
    assert "cannot" in viewer_page.locator(".alert").inner_text() or "not submit" in viewer_page.content()
    screenshot(viewer_page, "10-viewer-submit")
    token = viewer_page.evaluate("document.querySelector('input[name=csrfmiddlewaretoken]').value")
    refused = viewer_page.request.post(
        "/jobs/new/",
        form={"csrfmiddlewaretoken": token, "kind": "training", "gpus": "1", "command": "true"},
        headers={"Referer": f"{platform.url}/jobs/new/"},
    )
    assert refused.status == 403
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 2  # the two the owner submitted, nothing from the viewer

    # Another tenant's engineer gets a 404 for this job, its live parts and its log.
    _, stranger = owner_of("globex")
    stranger_page = page_for(stranger, password=PASSWORD)
    for path in (f"/jobs/{job_id}/", f"/jobs/{job_id}/live/", f"/jobs/{job_id}/log/", f"/jobs/{job_id}/metrics/"):
        assert stranger_page.goto(path).status == 404, path
    stranger_page.goto("/usage/")
    assert f"#{job_id}" not in stranger_page.locator("#usage-by-job").inner_text()
    assert Decimal(job.cost) > 0


def test_invited_viewer_joins_from_the_email_and_cannot_submit(live_server, rules, page_for, screenshot):
    from django.core import mail

    tenant, owner = owner_of("initech")
    page = page_for(owner, password=PASSWORD)
    page.goto("/team/")
    page.fill("#invite-form #id_email", "analyst@initech.test")
    page.select_option("#invite-form #id_role", "viewer")
    page.locator("#invite-form [type=submit]").click()
    page.wait_for_selector("#invitations")
    assert "analyst@initech.test as viewer" in page.locator("#invitations").inner_text()
    screenshot(page, "11-team-invited")

    link = re.search(r"https?://\S+/accounts/invite/\S+/", mail.outbox[-1].body).group(0)
    guest = page_for(None)
    guest.goto(link)
    guest.fill("#id_password1", PASSWORD)
    guest.fill("#id_password2", PASSWORD)
    guest.locator("form [type=submit]").click()
    guest.wait_for_url(f"{live_server.url}/")
    assert "Initech · viewer" in guest.locator(".tenant-name").inner_text()
    guest.goto("/jobs/new/")
    assert guest.locator("#submit-form [type=submit]").is_disabled()
    assert guest.locator("a.btn-primary", has_text="Submit a job").count() == 0
    guest.goto("/")
    assert guest.locator("a.btn-primary", has_text="Submit a job").count() == 0
