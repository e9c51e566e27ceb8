"""Jobs list (filters, search, sort, pages, bulk cancel) and query counts that do
not grow with the number of rows (no N+1 on any page or live partial)."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import Role
from accounts.services import token_create
from billing.models import Invoice, InvoiceLine
from scheduler.models import Job, JobState
from tests.factories import member_add
from tests.portal.conftest import job_make, job_ran

pytestmark = pytest.mark.django_db


def names(response) -> list[str]:
    page = response.content.decode()
    return [
        chunk.split("</a>", 1)[0].split(" ", 1)[1] for chunk in page.split('<a href="/jobs/')[1:] if "#" in chunk[:12]
    ]


def test_filters_search_sort_and_pages(client_for, tenant, node):
    owner = client_for(tenant)
    for i in range(30):
        job_make(tenant, user=owner.user, name=f"run-{i:02d}", kind="training" if i % 3 else "inference")
    done = job_ran(job_make(tenant, user=owner.user, name="finished"), node)
    url = reverse("portal:jobs")

    first = owner.get(url)
    assert names(first)[:2] == ["finished", "run-29"]  # newest first, 25 a page
    assert len(names(first)) == 25 and "Page 1 of 2" in first.content.decode()
    assert len(names(owner.get(url + "?page=2"))) == 6
    assert names(owner.get(url + "?state=succeeded")) == ["finished"]
    assert names(owner.get(url + "?q=run-0")) == [f"run-{i:02d}" for i in range(9, -1, -1)]
    assert names(owner.get(url + f"?q={done.pk}")) == ["finished"]
    inference = names(owner.get(url + "?kind=inference&sort=oldest"))
    assert inference == [f"run-{i:02d}" for i in range(0, 30, 3)]
    assert names(owner.get(url + "?sort=cost"))[0] == "finished"
    # Column headers sort, keeping the filters.
    headers = owner.get(url + "?state=queued&sort=cost").content.decode()
    assert (
        'href="?state=queued&amp;sort=name"' in headers
        and 'aria-sort="descending"><a href="?state=queued&amp;sort=cost"' in headers
    )
    # Filters survive paging.
    assert "state=queued&amp;page=2" in owner.get(url + "?state=queued").content.decode()


def test_bulk_cancel_cancels_what_it_can_and_says_so(client_for, tenant, node):
    owner = client_for(tenant)
    queued = [job_make(tenant, user=owner.user, name=f"q{i}") for i in range(3)]
    done = job_ran(job_make(tenant, user=owner.user), node)
    response = owner.post(reverse("portal:jobs_cancel"), {"job": [j.pk for j in queued] + [done.pk]}, follow=True)
    assert "Cancelling 3 jobs. 1 already finished" in response.content.decode()
    with scopes_disabled():
        states = set(Job.objects.filter(pk__in=[j.pk for j in queued]).values_list("state", flat=True))
        assert states == {JobState.CANCELLED}
        assert Job.objects.get(pk=done.pk).state == JobState.SUCCEEDED


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200, url
    return len(ctx.captured_queries)


def _fill(tenant, owner, node, n: int) -> list[Job]:
    jobs = [job_ran(job_make(tenant, user=owner.user, name=f"done-{i}"), node, windows=2) for i in range(n)]
    jobs += [job_make(tenant, user=owner.user, name=f"queued-{i}") for i in range(n)]
    for i in range(n):
        member_add(tenant, role=Role.MEMBER)
        token_create(tenant=tenant, user=owner.user, name=f"ci-{i}")
    with scopes_disabled():
        invoice = Invoice.objects.create(tenant=tenant, month=date(2000 + n, 1, 1), total=Decimal("1.00"))
        for i in range(n):
            InvoiceLine.objects.create(
                tenant=tenant,
                invoice=invoice,
                gpu_model=f"M{i}",
                mode="dedicated",
                priority_class="standard",
                rate_per_gpu_hour=Decimal("1"),
                gpu_ms=1000,
                exact_amount=Decimal("0.1"),
                amount=Decimal("0.10"),
            )
    return jobs


@pytest.mark.parametrize(
    "url_name",
    ["portal:dashboard", "portal:dashboard_live", "portal:jobs", "portal:usage", "portal:team", "portal:job"],
)
def test_page_queries_do_not_grow_with_rows(client_for, tenant, node, url_name, django_assert_max_num_queries):
    owner = client_for(tenant)
    few = _fill(tenant, owner, node, 2)
    url = reverse(url_name, kwargs={"pk": few[0].pk} if url_name == "portal:job" else {})
    baseline = _queries(owner, url)
    _fill(tenant, owner, node, 12)
    with django_assert_max_num_queries(baseline):
        owner.get(url)
    print(f"QUERIES {url_name}: {baseline}")
    assert baseline <= 30, f"{url_name}: {baseline} queries"


def test_live_partials_are_cheap(client_for, tenant, node, django_assert_max_num_queries):
    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user), node, windows=50)
    for name, limit in [("portal:job_live", 16), ("portal:job_log", 12), ("portal:job_metrics", 12)]:
        with django_assert_max_num_queries(limit):
            assert owner.get(reverse(name, kwargs={"pk": job.pk})).status_code == 200


def test_invoices_show_for_owners_with_lines_and_links_not_for_viewers(client_for, tenant, other_tenant, node):
    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user), node)
    with scopes_disabled():
        invoice = Invoice.objects.create(
            tenant=tenant, month=job.submitted_at.date().replace(day=1), total=Decimal("12.34")
        )
        InvoiceLine.objects.create(
            tenant=tenant,
            invoice=invoice,
            gpu_model="H100-80GB",
            mode="dedicated",
            priority_class="standard",
            rate_per_gpu_hour=Decimal("2.49"),
            gpu_ms=3_600_000,
            exact_amount=Decimal("2.49"),
            amount=Decimal("2.49"),
        )
        theirs = Invoice.objects.create(tenant=other_tenant, month=invoice.month, total=Decimal("99.99"))
    page = owner.get(reverse("portal:usage")).content.decode()
    assert "$12.34" in page and "H100-80GB · dedicated · standard" in page
    assert reverse("portal:invoice", kwargs={"invoice_id": invoice.pk}) in page
    assert reverse("portal:invoice_csv", kwargs={"invoice_id": invoice.pk}) in page
    assert f'data-invoice="{theirs.pk}"' not in page and "$99.99" not in page
    viewer = client_for(tenant, role=Role.VIEWER)
    assert "$12.34" not in viewer.get(reverse("portal:usage")).content.decode()
