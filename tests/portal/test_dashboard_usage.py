"""What the dashboard and the usage page compute: spend against budget, quotas,
usage by day/model/job; the job page's live parts stop when the job ends."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils.html import strip_tags
from django_scopes import scopes_disabled

from accounts.services import quota_set
from scheduler.models import Job, JobState
from tests.portal.conftest import job_make, job_ran

pytestmark = pytest.mark.django_db


def test_dashboard_shows_spend_against_budget_and_quota_bars(client_for, tenant, node):
    owner = client_for(tenant)
    job_ran(job_make(tenant, user=owner.user), node, windows=4, amount="2.5")  # $10 this month
    quota_set(
        tenant=tenant, actor=None, monthly_spend_limit=Decimal("12"), budget_alert_percent=80, max_dedicated_gpus=4
    )
    held = job_make(tenant, user=owner.user, name="holding", max_runtime_s=60)  # its hold fits the $2 left
    with scopes_disabled():
        from scheduler.models import Allocation

        gpu = node.gpus.get(index=1)
        Allocation.objects.create(tenant=tenant, job=held, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=held.pk).update(state=JobState.RUNNING, node=node)
    page = owner.get(reverse("portal:dashboard")).content.decode()
    text = strip_tags(page)
    assert "$10.00" in text and "of a $12.00 budget" in text
    assert 'aria-valuenow="83"' in page  # 10 of 12 used
    assert "Spend has passed this month&#x27;s alert threshold." in page
    assert "1 GPU L4-24GB · dedicated · 1 job" in page
    assert "1 / 4" in page  # dedicated GPUs held against the quota
    live = owner.get(reverse("portal:dashboard_live")).content.decode()
    assert f'data-job="{held.pk}"' in live and "badge-running" in live


def test_dashboard_says_when_the_budget_is_used_up(client_for, tenant, node):
    owner = client_for(tenant)
    job_ran(job_make(tenant, user=owner.user), node, windows=2, amount="5")
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("10"))
    page = owner.get(reverse("portal:dashboard")).content.decode()
    assert "This month&#x27;s budget is used up: new jobs are refused." in page


def test_usage_page_sums_by_day_model_and_job(client_for, tenant, other_tenant, node):
    owner = client_for(tenant)
    a = job_ran(job_make(tenant, user=owner.user, name="a"), node, windows=3, window_ms=60_000, amount="0.1")
    b = job_ran(job_make(tenant, user=owner.user, name="b"), node, windows=2, window_ms=60_000, amount="0.25")
    theirs = job_ran(job_make(other_tenant, name="theirs"), node, windows=5, amount="9.1111")
    page = owner.get(reverse("portal:usage")).content.decode()
    # 3 x 0.10 + 2 x 0.25, theirs excluded: to the cent on the page, the exact figure on hover.
    assert '<div class="stat" id="usage-total"><span class="money" title="$0.80 exact">$0.80</span></div>' in page
    assert f'<tr data-job="{b.pk}">' in page and f'<tr data-job="{a.pk}">' in page
    assert page.index(f'data-job="{b.pk}"') < page.index(f'data-job="{a.pk}"')  # most expensive first
    assert "0.083" in page  # 5 GPU-minutes = 0.083 GPU-hours
    # Their $45.5555 is in no figure and their job in no row. (Not `"$9" not in page`: the month-end
    # projection scales $0.80 by the month's elapsed share and reads $9.xx on some days.)
    assert "theirs" not in page and f'data-job="{theirs.pk}"' not in page
    assert "$45.5555" not in page and "$45.56" not in page and "$9.1111" not in page
    last_month = owner.get(reverse("portal:usage") + "?month=2001-01").content.decode()
    assert "No usage metered in January 2001" in last_month
    assert owner.get(reverse("portal:usage") + "?month=garbage").status_code == 200


def test_live_part_polls_while_active_and_stops_when_ended(client_for, tenant, node):
    owner = client_for(tenant)
    queued = job_make(tenant, user=owner.user)
    live = owner.get(reverse("portal:job_live", kwargs={"pk": queued.pk})).content.decode()
    assert 'hx-trigger="every 2s"' in live and "Why pending:" in live and "Cancel job" in live
    ended = job_ran(job_make(tenant, user=owner.user), node)
    live = owner.get(reverse("portal:job_live", kwargs={"pk": ended.pk})).content.decode()
    assert "hx-trigger" not in live and "Cancel job" not in live


def test_cancel_from_the_page_with_htmx_returns_the_updated_part(client_for, tenant):
    owner = client_for(tenant)
    job = job_make(tenant, user=owner.user)
    response = owner.post(reverse("portal:job_cancel", kwargs={"pk": job.pk}), HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    body = response.content.decode()
    assert body.startswith('<div id="job-live"') and 'data-state="cancelled"' in body
    with scopes_disabled():
        assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


def test_log_poller_stops_a_few_reads_after_the_job_ends(client_for, tenant, node):
    owner = client_for(tenant)
    job = job_ran(job_make(tenant, user=owner.user), node)
    url = reverse("portal:job_log", kwargs={"pk": job.pk})
    idle = 0
    for _ in range(5):
        body = owner.get(url + f"?offset=0&idle={idle}").content.decode()
        if "data-complete" in body:
            break
        idle += 1
    assert "data-complete" in body and idle == 2


def test_number_formatting():
    from portal.templatetags.portal import billed, duration_ms, gpus, money, money_exact, money_text, plain

    assert [plain(Decimal("10.000")), plain(Decimal("0.250")), plain(4)] == ["10", "0.25", "4"]
    # Pages: to the cent, the exact figure on hover; invoices as billed.
    amounts = [Decimal("1234.565"), Decimal("0.00437"), Decimal("0.0062"), 0, Decimal("-2")]
    assert [money_text(a) for a in amounts] == ["$1,234.57", "<$0.01", "$0.01", "$0.00", "-$2.00"]
    assert [money_exact(a) for a in amounts] == ["$1234.565", "$0.00437", "$0.0062", "$0.00", "-$2.00"]
    assert money(Decimal("0.0123456789")) == '<span class="money" title="$0.0123456789 exact">$0.01</span>'
    assert billed(Decimal("12.30")) == "$12.30"
    assert [gpus(1000), gpus(3000), gpus(250), gpus(125)] == ["1 GPU", "3 GPUs", "¼ GPU", "⅛ GPU"]
    assert [duration_ms(12_345), duration_ms(185_000), duration_ms(3_720_000)] == ["12.3s", "3m 05s", "1h 02m"]
