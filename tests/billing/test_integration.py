"""Billing with the real thing: an agent process meters a job, the worker ingests, and the month
closes into an invoice whose ledger balances; at the spend limit accounts stops the running job."""

from __future__ import annotations

import io
import sys
from datetime import date
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import RunningJobsPolicy, TenantQuota
from admission.services import budgets_enforce
from billing.models import Charge, Invoice
from billing.selectors import ledger_month, tenant_month_spend
from billing.services.invoices import invoice_close
from scheduler.models import Job
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

SLEEP = "import time; time.sleep({})"


def submit(platform, session, body: dict) -> int:
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def state(job_id: int) -> str:
    with scopes_disabled():
        return Job.objects.get(pk=job_id).state


def test_metered_jobs_close_into_an_invoice_and_the_ledger_balances(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant, scopes=["jobs:read", "jobs:write", "usage:read", "billing:read"])
    whole = submit(
        platform, session, {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", SLEEP.format(2)]}
    )
    slice_ = submit(
        platform, session, {"kind": "inference", "gpus": 0.25, "command": [sys.executable, "-c", SLEEP.format(2)]}
    )
    wait_for(lambda: state(whole) == "succeeded" and state(slice_) == "succeeded", timeout=60, what="both jobs")

    with scopes_disabled():
        jobs = {j.pk: j for j in Job.objects.filter(pk__in=[whole, slice_])}
        month = date(timezone.now().year, timezone.now().month, 1)
        charges = list(Charge.objects.filter(tenant=tenant))
        assert {c.job_id for c in charges} == {whole, slice_}
        assert {c.mode for c in charges if c.job_id == slice_} == {"shared"}
        assert sum(c.amount for c in charges) == sum(j.cost for j in jobs.values())
        assert tenant_month_spend(tenant=tenant, at=timezone.now()) == sum(j.cost for j in jobs.values())

        invoice = invoice_close(tenant=tenant, month=month)
        assert invoice_close(tenant=tenant, month=month).pk == invoice.pk
        assert Invoice.objects.filter(tenant=tenant).count() == 1
        assert invoice.total == sum(line.amount for line in invoice.lines.all())
        assert invoice.lines.count() == 2  # H100-or-L4 dedicated/standard and shared/serving

        report = ledger_month(month=month, until=timezone.now())
    assert report.problems == []
    held = sum(g.held for g in report.gpus)
    # Every billed ms is on a GPU (held is exact milli-GPU-ms; a slice's billed gpu_ms floors < 1 ms per window).
    assert 0 <= held - sum(j.gpu_ms for j in jobs.values()) * 1000 < len(charges) * 1000
    assert all(g.held + g.idle + g.out_of_service == g.capacity for g in report.gpus)

    response = session.get(f"{platform.url}/api/v1/invoices/{invoice.pk}/", timeout=10).json()
    assert Decimal(response["total"]) == invoice.total
    out = io.StringIO()
    call_command("ledger_check", "--month", f"{month:%Y-%m}", stdout=out)
    assert "ledger check passed" in out.getvalue()


def test_spend_limit_stops_the_running_job(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="spender")
    with scopes_disabled():
        TenantQuota.objects.create(
            tenant=tenant, monthly_spend_limit=Decimal("100.00"), on_budget_exhausted=RunningJobsPolicy.STOP
        )
    session = platform.session_for(tenant)
    job_id = submit(
        platform, session, {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", SLEEP.format(60)]}
    )
    # Admission held the job's max cost against $100; the operator then lowers the budget under the
    # job (a hold never lets new work pass the budget, so only a change like this can leave a job over it).
    with scopes_disabled():
        TenantQuota.objects.filter(tenant=tenant).update(monthly_spend_limit=Decimal("0.01"))

    # An H100 costs 2.49/h: about 15 s of metered windows exhaust the limit.
    def spend():
        with scopes_disabled():
            return tenant_month_spend(tenant=tenant, at=timezone.now())

    wait_for(
        lambda: spend() >= Decimal("0.01"),
        timeout=60,
        what="metered spend above the limit",
    )
    assert budgets_enforce()["stopped"] == 1
    wait_for(lambda: state(job_id) in {"cancelled", "failed"}, timeout=60, what="the job to stop")
    refused = session.post(
        f"{platform.url}/api/v1/jobs/", json={"kind": "training", "gpus": 1, "command": ["true"]}, timeout=10
    )
    assert refused.status_code in (402, 403, 409, 429) and refused.json()["error"]["code"] == "budget_exhausted"
