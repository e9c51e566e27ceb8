"""The operator's billing console renders across tenants and acts through services."""

from __future__ import annotations

from datetime import date

import pytest
from django.test import Client
from django_scopes import scopes_disabled

from billing.models import Charge, Invoice, TenantDiscount
from billing.services import usage_windows_ingest
from billing.services.invoices import invoices_close_month
from tests.billing.conftest import ms, window
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator():
    client = Client()
    client.force_login(UserFactory(is_staff=True, is_superuser=True))
    return client


def test_invoice_console_lists_shows_lines_and_voids(operator, fleet, tenant, other_tenant):
    node = fleet.node()
    for i, t in enumerate((tenant, other_tenant)):
        job = fleet.job(t, node=node, gpu_indexes=[i])
        usage_windows_ingest(node=node, windows=[window(job, 0, ms(2026, 3, 2), ms(2026, 3, 2, 0, 10))])
    invoices_close_month(month=date(2026, 3, 1))
    with scopes_disabled():
        invoice = Invoice.objects.get(tenant=tenant)

    listing = operator.get("/admin/billing/invoice/")
    detail = operator.get(f"/admin/billing/invoice/{invoice.pk}/change/")
    voided = operator.post("/admin/billing/invoice/", {"action": "void", "_selected_action": [invoice.pk]}, follow=True)

    assert listing.status_code == 200 and b"tenant-a" in listing.content and b"tenant-b" in listing.content
    assert detail.status_code == 200 and b"H100-80GB" in detail.content
    assert voided.status_code == 200
    with scopes_disabled():
        assert Invoice.objects.get(pk=invoice.pk).state == Invoice.State.VOID
        assert not Charge.objects.filter(batch__invoice=invoice).exists()  # back to uninvoiced: the next invoice


def test_discount_console_adds_a_discount(operator, tenant):
    response = operator.post(
        "/admin/billing/tenantdiscount/add/",
        {"tenant": tenant.pk, "percent": "15", "effective_from_0": "2026-04-01", "effective_from_1": "00:00:00"},
    )
    assert response.status_code == 302, response.content[:2000]
    with scopes_disabled():
        assert TenantDiscount.objects.get(tenant=tenant).percent == 15
    assert operator.get("/admin/billing/tenantdiscount/").status_code == 200
