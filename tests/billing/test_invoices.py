"""Closing a month: one invoice per tenant, idempotent, lines rounded once, CSV and printable view."""

from __future__ import annotations

import csv
import io
from datetime import date
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.test import Client
from django_scopes import scopes_disabled

from billing.models import Charge, ChargeBatch, Invoice, InvoiceLine, UsageWindow
from billing.services import usage_windows_ingest
from billing.services.invoices import (
    InvoiceError,
    invoice_close,
    invoice_transition,
    invoice_void,
    invoices_close_month,
)
from tests.billing.conftest import ms, window
from tests.factories import member_add

pytestmark = pytest.mark.django_db

MARCH, APRIL = date(2026, 3, 1), date(2026, 4, 1)


@pytest.fixture
def march_usage(fleet, tenant, other_tenant):
    """Tenant A: 2 H100 dedicated (standard) + a 1/8 slice of an L4 (preemptible), across the month end."""
    node = fleet.node()
    big = fleet.job(tenant, node=node, gpu_milli=2000)
    small = fleet.job(tenant, node=node, model="L4-24GB", gpu_milli=125, priority="preemptible")
    other = fleet.job(other_tenant, node=node, model="L4-24GB", gpu_milli=1000)
    t = ms(2026, 3, 31, 23, 58)
    windows = [window(big, s, t + s * 60_000, t + (s + 1) * 60_000, sm_util_ms=90_000) for s in range(4)]
    windows += [window(small, s, t + s * 7_777, t + (s + 1) * 7_777, energy_mj=1000) for s in range(20)]
    windows += [window(other, 0, t, t + 60_000)]
    usage_windows_ingest(node=node, windows=windows)
    return big, small, other


def test_close_twice_makes_one_invoice_per_tenant(march_usage, tenant, other_tenant):
    first = invoices_close_month(month=MARCH)
    second = invoices_close_month(month=MARCH)
    call_command("close_invoices", "--month", "2026-03", stdout=io.StringIO())

    with scopes_disabled():
        assert Invoice.objects.filter(month=MARCH).count() == 2
        assert len(first) == 2 and second == []  # nothing left to close
        assert {i.pk: i.total for i in first} == dict(Invoice.objects.values_list("pk", "total"))
        a = Invoice.objects.get(tenant=tenant, month=MARCH)
        # Only March charges are on the March invoice; April's wait for April.
        assert not Charge.objects.filter(batch__invoice=a, month=APRIL).exists()
        assert Charge.objects.filter(tenant=tenant, month=APRIL, batch__invoice__isnull=True).exists()
        assert InvoiceLine.objects.filter(invoice=a).count() == 2  # H100 dedicated standard, L4 shared preemptible


def test_lines_round_once_and_sum_to_the_total(march_usage, tenant):
    invoices_close_month(month=MARCH)
    with scopes_disabled():
        invoice = Invoice.objects.get(tenant=tenant, month=MARCH)
        lines = list(invoice.lines.all())
        exact = sum(c.amount for c in Charge.objects.filter(batch__invoice=invoice))
    assert invoice.total == sum(line.amount for line in lines)
    assert sum(line.exact_amount for line in lines) == exact
    h100 = next(line for line in lines if line.gpu_model == "H100-80GB")
    # 2 GPUs × 120 s (March part) at 2.49/h = 0.166 → 0.17
    assert h100.gpu_ms == 240_000
    assert h100.exact_amount == Decimal("0.1660000000")
    assert h100.amount == Decimal("0.17")
    assert h100.sm_util_ms == 180_000


def test_late_usage_goes_on_the_next_invoice(march_usage, fleet, tenant):
    big, _, _ = march_usage
    invoices_close_month(month=MARCH)
    late_start = ms(2026, 3, 15)
    usage_windows_ingest(node=big.node, windows=[window(big, 99, late_start, late_start + 60_000)])
    invoices_close_month(month=MARCH)
    invoices_close_month(month=APRIL)
    with scopes_disabled():
        late = Charge.objects.get(window__seq=99, window__job=big)
        assert late.invoice.month == APRIL


def test_state_machine_refuses_illegal_transitions(march_usage, tenant):
    invoices_close_month(month=MARCH)
    with scopes_disabled():
        invoice = Invoice.objects.get(tenant=tenant, month=MARCH)
    invoice_transition(invoice, Invoice.State.VOID)
    with pytest.raises(InvoiceError, match="cannot go from void to paid"):
        invoice_transition(invoice, Invoice.State.PAID)


def test_close_command_rejects_a_bad_month(db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="YYYY-MM"):
        call_command("close_invoices", "--month", "2026-13", stdout=io.StringIO())


def test_printable_invoice_and_csv_for_owners_only(march_usage, tenant, other_tenant):
    invoices_close_month(month=MARCH)
    with scopes_disabled():
        invoice = Invoice.objects.get(tenant=tenant, month=MARCH)
        lines_exact = sum(line.exact_amount for line in invoice.lines.all())
    member, outsider = member_add(tenant, role="owner"), member_add(other_tenant, role="owner")
    plain_member = member_add(tenant, role="member")
    client = Client()

    client.force_login(member)
    page = client.get(f"/billing/invoices/{invoice.pk}/")
    rows = list(csv.DictReader(io.StringIO(client.get(f"/billing/invoices/{invoice.pk}/jobs.csv").content.decode())))
    client.force_login(plain_member)
    not_allowed = client.get(f"/billing/invoices/{invoice.pk}/")
    client.force_login(outsider)
    foreign = client.get(f"/billing/invoices/{invoice.pk}/")
    foreign_csv = client.get(f"/billing/invoices/{invoice.pk}/jobs.csv")

    assert page.status_code == 200
    assert b"css/invoice.css" in page.content and str(invoice.total).encode() in page.content  # print styles
    assert {r["job_id"] for r in rows} == {str(j.pk) for j in march_usage[:2]}
    assert sum(Decimal(r["exact_amount"]) for r in rows) == lines_exact
    assert foreign.status_code == 404 and foreign_csv.status_code == 404
    assert not_allowed.status_code == 404  # billing is for owners (accounts.permissions)


def test_a_voided_invoices_charges_go_on_the_next_one(march_usage, tenant):
    invoices_close_month(month=MARCH)
    with scopes_disabled():
        march = Invoice.objects.get(tenant=tenant, month=MARCH)
        march_exact = sum(line.exact_amount for line in march.lines.all())
    invoice_void(invoice=march, reason="wrong address")

    invoices_close_month(month=APRIL)

    with scopes_disabled():
        april = Invoice.objects.get(tenant=tenant, month=APRIL)
        on_april = Charge.objects.filter(batch__invoice=april)
        assert on_april.filter(month=MARCH).exists() and on_april.filter(month=APRIL).exists()
        assert sum(line.exact_amount for line in april.lines.all()) > march_exact
        assert sum(c.amount for c in on_april) == sum(line.exact_amount for line in april.lines.all())
        assert not Charge.objects.filter(tenant=tenant, batch__invoice__isnull=True).exists()


def _stray_charges(job, tenant, *, amount: str, count: int = 1) -> None:
    """Charges written outside ingest (no batch), like a fixture or a manual correction."""
    with scopes_disabled():
        w = UsageWindow.objects.filter(job=job).first()
        Charge.objects.bulk_create(
            Charge(
                tenant=tenant, window=w, job=job, month=MARCH, start_ms=w.start_ms, end_ms=w.end_ms,
                gpu_model="L4-24GB", mode="dedicated", priority_class="correction", rate_per_gpu_hour=Decimal(1),
                gpu_ms=0, amount=Decimal(amount),
            )
            for _ in range(count)
        )  # fmt: skip


def test_charges_written_outside_ingest_are_invoiced_too(march_usage, other_tenant):
    _, _, other = march_usage
    _stray_charges(other, other_tenant, amount="1.005")

    invoices_close_month(month=MARCH)

    with scopes_disabled():
        invoice = Invoice.objects.get(tenant=other_tenant, month=MARCH)
        correction = invoice.lines.get(priority_class="correction")
        assert not Charge.objects.filter(batch__isnull=True).exists()
    assert (correction.exact_amount, correction.amount) == (Decimal("1.005"), Decimal("1.01"))


def test_one_tenants_failure_loses_no_other_tenants_invoice(march_usage, tenant, other_tenant, caplog):
    _, _, other = march_usage
    # 101 × ~10^10: the line overflows what an invoice line can hold, so other_tenant's close fails.
    _stray_charges(other, other_tenant, amount="9999999999", count=101)

    closed = invoices_close_month(month=MARCH)

    assert [i.tenant_id for i in closed] == [tenant.pk]
    with scopes_disabled():
        assert Invoice.objects.get(tenant=tenant, month=MARCH).lines.count() == 2
        assert not Invoice.objects.filter(tenant=other_tenant).exists()
        # Nothing of the failed tenant was marked: it is all there for the next run.
        assert not ChargeBatch.objects.filter(tenant=other_tenant, invoice__isnull=False).exists()
    assert f"closing 2026-03 for tenant {other_tenant.pk} failed" in caplog.text


def test_close_query_count_does_not_grow_with_tenants(fleet, django_assert_max_num_queries):
    from tests.factories import TenantFactory

    node = fleet.node(gpus=("L4-24GB",) * 8)
    for i in range(8):
        job = fleet.job(TenantFactory(), node=node, model="L4-24GB", gpu_indexes=[i])
        usage_windows_ingest(node=node, windows=[window(job, 0, ms(2026, 3, 2), ms(2026, 3, 2, 0, 10))])

    with django_assert_max_num_queries(12):
        closed = invoices_close_month(month=MARCH)

    assert len(closed) == 8 and all(i.total > 0 for i in closed)


def test_closing_one_tenant_again_returns_its_invoice(march_usage, tenant):
    first = invoice_close(tenant=tenant, month=MARCH)
    again = invoice_close(tenant=tenant, month=date(2026, 3, 17))

    assert first is not None and again.pk == first.pk
    with scopes_disabled():
        assert Invoice.objects.filter(tenant=tenant).count() == 1
