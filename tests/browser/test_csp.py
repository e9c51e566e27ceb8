"""The content security policy breaks no page: every portal, account, billing, console, admin
and API-docs page is opened in Chromium under the policy and must raise no CSP violation and
no script error, and the behaviours that used inline handlers before (confirm before revoking
a token, print an invoice) still work from portal.js."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Membership, Role
from accounts.services import member_invite, tenant_create, token_create
from agents.models import Gpu, Node
from billing.models import Invoice
from endpoints.services import EndpointSpec, endpoint_create
from tests.browser.conftest import CSP_EXPECTED
from tests.factories import UserFactory
from tests.portal.conftest import job_make, job_ran

pytestmark = pytest.mark.browser

PASSWORD = "correct-horse-battery"


def watch(page) -> list[str]:
    """Collect CSP violations (Chromium reports each on the console) and uncaught script errors."""
    problems: list[str] = []
    page.on(
        "console",
        lambda msg: "Content Security Policy" in msg.text and problems.append(f"{page.url}: {msg.text}"),
    )
    page.on("pageerror", lambda exc: problems.append(f"{page.url}: script error: {exc}"))
    page.add_init_script(
        "document.addEventListener('securitypolicyviolation', e => console.error("
        "'Content Security Policy violation: ' + e.violatedDirective + ' ' + e.blockedURI));"
    )
    return problems


@pytest.fixture
def portal_data(rules):
    tenant = tenant_create(slug="csp", name="Csp", owner_email="owner@csp.test", owner_password=PASSWORD)
    with scopes_disabled():
        owner = Membership.objects.select_related("user").get(tenant=tenant).user
    node = Node.objects.create(name="node-csp", state=Node.State.UP, token_hash="x", backend="sim")
    for index, model in enumerate(["H100-80GB", "L4-24GB"]):
        Gpu.objects.create(node=node, uuid=f"GPU-csp-{index}", index=index, model=model, memory_mb=81920)
    job = job_ran(job_make(tenant, user=owner, name="train"), node)
    endpoint = endpoint_create(
        tenant=tenant,
        user=None,
        spec=EndpointSpec(name="llm", command=["python", "serve.py"], gpu_milli=250, min_replicas=0, max_replicas=2),
    )
    token_create(tenant=tenant, user=owner, name="ci")
    with scopes_disabled():
        invoice = Invoice.objects.create(
            tenant=tenant,
            month=date(2026, 3, 1),
            total=Decimal("4.98"),
            state=Invoice.State.OPEN,
            sent_at=timezone.now(),
        )
    invite = member_invite(tenant=tenant, actor=owner, email="new@csp.test")
    staff = UserFactory(username="ops@csp.test", is_staff=True, is_superuser=True)
    staff.set_password(PASSWORD)
    staff.save()
    return {"owner": owner, "staff": staff, "job": job, "endpoint": endpoint, "invoice": invoice, "invite": invite}


def test_every_page_passes_the_policy(page_for, live_server, portal_data):
    import requests

    anonymous = page_for(None)
    anon_problems = watch(anonymous)
    for path in (
        "/accounts/login/",
        "/accounts/signup/",
        "/accounts/password_reset/",
        f"/accounts/invite/{portal_data['invite'].plaintext}/",
        "/api/docs/",
        "/api/docs/try/",
    ):
        response = anonymous.goto(path)
        assert response.status == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"], path
        anonymous.wait_for_load_state("networkidle")
    # The docs' own code ran (Redoc and Swagger UI draw the API): not just an empty page.
    anonymous.goto("/api/docs/")
    anonymous.wait_for_selector("text=gpushare API", timeout=30_000)
    anonymous.goto("/api/docs/try/")
    anonymous.wait_for_selector(".swagger-ui .info", timeout=30_000)

    owner = page_for(portal_data["owner"], password=PASSWORD)
    problems = watch(owner)
    job, endpoint, invoice = portal_data["job"], portal_data["endpoint"], portal_data["invoice"]
    for path in (
        "/",
        "/jobs/",
        "/jobs/new/",
        f"/jobs/{job.pk}/",
        "/endpoints/",
        f"/endpoints/{endpoint.pk}/",
        "/usage/",
        "/team/",
        f"/billing/invoices/{invoice.pk}/",
    ):
        response = owner.goto(path)
        assert response.status == 200, path
        owner.wait_for_load_state("networkidle")
    # Charts are drawn by our scripts (Chart.js from our origin) on the job page.
    owner.goto(f"/jobs/{job.pk}/")
    owner.wait_for_function("() => document.querySelector('canvas[data-series=sm]').width > 0")

    staff = page_for(portal_data["staff"], password=PASSWORD)
    staff_problems = watch(staff)
    for path in (
        "/console/",
        "/console/fleet/",
        "/console/queue/",
        "/console/rules/",
        "/console/reports/",
        "/admin/",
        "/admin/billing/invoice/",
        "/billing/ledger/",
    ):
        response = staff.goto(path)
        assert response.status == 200, path
        staff.wait_for_load_state("networkidle")

    # Redoc's CDN logo is blocked on purpose (conftest.CSP_EXPECTED), the only expected report.
    unexpected = [p for p in anon_problems if not any(url in p for url in CSP_EXPECTED)] + problems + staff_problems
    assert unexpected == [], "\n".join(unexpected)
    # A plain request gets the header too (every response, not only pages a browser opened).
    assert (
        "frame-ancestors 'none'"
        in requests.get(f"{live_server.url}/accounts/login/", timeout=10).headers["Content-Security-Policy"]
    )


def test_confirm_and_print_work_without_inline_handlers(page_for, portal_data):
    owner = page_for(portal_data["owner"], password=PASSWORD)
    problems = watch(owner)
    dialogs: list[str] = []

    def answer(dialog):
        dialogs.append(dialog.message)
        dialog.dismiss()  # "Cancel": the form must not be sent

    owner.on("dialog", answer)
    owner.goto("/team/")
    owner.locator("form[data-confirm] button", has_text="Revoke").first.click()
    owner.wait_for_timeout(300)
    assert dialogs and dialogs[0].startswith("Revoke gps_") and "401" in dialogs[0]
    assert "ci" in owner.locator("#tokens").inner_text()  # still there: cancelled
    with scopes_disabled():
        assert portal_data["owner"].api_tokens.filter(revoked_at__isnull=True).exists()

    owner.goto(f"/billing/invoices/{portal_data['invoice'].pk}/")
    owner.evaluate("() => { window.__printed = 0; window.print = () => { window.__printed += 1; }; }")
    owner.locator("button[data-print]").click()
    assert owner.evaluate("() => window.__printed") == 1
    assert problems == []


def test_only_an_owner_sees_the_any_address_option(page_for, portal_data):
    with scopes_disabled():
        tenant = Membership.objects.get(user=portal_data["owner"]).tenant
    admin = UserFactory(username="admin@csp.test")
    admin.set_password(PASSWORD)
    admin.save()
    with scopes_disabled():
        Membership.objects.create(tenant=tenant, user=admin, role=Role.ADMIN)
    owner = page_for(portal_data["owner"], password=PASSWORD)
    owner.goto("/team/")
    assert owner.locator("#id_any_address").count() == 1
    other = page_for(admin, password=PASSWORD)
    other.goto("/team/")
    assert other.locator("#id_any_address").count() == 0
