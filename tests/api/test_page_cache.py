"""Job list pages kept by the web process (scheduler.api.page_selectors) are served again only while nothing
they were written from has changed: every input of a page is changed in turn, and the page served next is
held equal to one written afresh; an unchanged page is served from the cache (only the versions statement
runs).

These tests commit (``transaction=True``): the cache is not used inside a transaction, which is where every
other API test runs.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from scheduler.api import page_selectors
from scheduler.api.page_selectors import PageCache, job_page_statement, job_page_versions_statement
from scheduler.models import Allocation, Job, JobState, PriorityClass
from tests.factories import wait_for

from .helpers import job_make, node_make

pytestmark = pytest.mark.django_db(transaction=True)

BASE = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def empty_cache():
    page_selectors.pages.clear()
    yield
    page_selectors.pages.clear()


@pytest.fixture
def finished(rules, tenant, other_tenant):
    """Six finished jobs of ``tenant`` on a node (two holding GPUs), one of ``other_tenant``'s between them.
    The node is cordoned: a pass that a submit asks for places nothing (the fixture writes the allocations)."""
    node = node_make("node-a", gpus=4)
    Node.objects.filter(pk=node.pk).update(state=Node.State.CORDONED)
    gpus = list(node.gpus.order_by("index"))
    jobs = []
    for i in range(6):
        jobs.append(job_make(tenant, name=f"job {i}", gpu_milli=1000))
        if i == 2:
            job_make(other_tenant, name="theirs")
    with scopes_disabled():
        for i, job in enumerate(jobs):
            Job.objects.filter(pk=job.pk).update(
                state=JobState.SUCCEEDED,
                node=node,
                started_at=BASE + timedelta(minutes=i),
                finished_at=BASE + timedelta(minutes=i, seconds=30),
                exit_code=0,
                gpu_ms=30_000,
            )
            if i in (4, 5):
                Allocation.objects.create(tenant=tenant, job=job, gpu=gpus[i - 4], share_milli=1000)
        Job.objects.filter(tenant=other_tenant).update(state=JobState.CANCELLED)
    return jobs


def statements(captured) -> set[str]:
    """Which of the page's statements ran: "page" (written afresh) and "versions" (checked)."""
    names = {}
    for older in (True, False):
        for after in (True, False):
            for size in (2, 3, 50):
                names[job_page_statement(after=after, older=older, size=size).name] = "page"
                names[job_page_versions_statement(after=after, older=older, size=size).name] = "versions"
    ran = set()
    for query in captured.captured_queries:
        for name, kind in names.items():
            if f"EXECUTE {name} " in query["sql"] or query["sql"].endswith(f"EXECUTE {name}"):
                ran.add(kind)
    return ran


def get(client, url="/api/v1/jobs/"):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, response.content[:300]
    return response.json(), statements(captured)


def fresh(client, url="/api/v1/jobs/"):
    """The page as written without any kept page."""
    page_selectors.pages.clear()
    body, ran = get(client, url)
    assert ran == {"page"}
    return body


def test_an_unchanged_page_is_served_from_the_cache_and_is_the_same_document(finished, tenant, api_client_for):
    client = api_client_for(tenant)
    first, ran = get(client)
    assert ran == {"page"}
    again, ran = get(client)
    assert ran == {"versions"}  # checked, not written
    assert again == first
    assert [job["id"] for job in again["results"]] == [job.pk for job in reversed(finished)]


CHANGES = {
    "a job's usage (metering)": lambda jobs: Job.objects.filter(pk=jobs[3].pk).update(gpu_ms=31_000),
    "a job's state": lambda jobs: Job.objects.filter(pk=jobs[1].pk).update(state=JobState.FAILED, exit_code=1),
    "a job's name, set to the same value": lambda jobs: Job.objects.filter(pk=jobs[2].pk).update(name="job 2"),
    "a job deleted": lambda jobs: Job.objects.filter(pk=jobs[2].pk).delete(),
    "a class renamed": lambda jobs: PriorityClass.objects.filter(pk=jobs[0].priority_id).update(name="renamed"),
    "a node renamed": lambda jobs: Node.objects.filter(name="node-a").update(name="node-b"),
    "an allocation released": lambda jobs: Allocation.objects.filter(job=jobs[5]).update(released_at=BASE),
    "an allocation made": lambda jobs: Allocation.objects.create(
        tenant=jobs[0].tenant, job=jobs[0], gpu=Gpu.objects.get(index=3), share_milli=1000
    ),
    "a GPU renumbered": lambda jobs: Gpu.objects.filter(index=1).update(index=7),
    "a GPU's uuid": lambda jobs: Gpu.objects.filter(index=0).update(uuid="GPU-replaced"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_any_change_to_what_a_page_shows_is_served_at_once(change, finished, tenant, api_client_for):
    client = api_client_for(tenant)
    get(client)
    assert get(client)[1] == {"versions"}
    with scopes_disabled():
        CHANGES[change](finished)
    served, ran = get(client)
    assert ran == {"versions", "page"}  # checked, found changed, written afresh
    assert served == fresh(client)
    assert get(client)[1] == {"versions"}  # and kept again


def _class_repriced(jobs):
    klass = jobs[0].priority
    PriorityClass.objects.filter(pk=klass.pk).update(name=klass.name, price_multiplier="1.5")


UNSHOWN_WRITES = {
    "a node's heartbeat": lambda jobs: Node.objects.filter(name="node-a").update(last_heartbeat_at=BASE),
    "a node's state": lambda jobs: Node.objects.filter(name="node-a").update(state=Node.State.UP),
    "a GPU's health": lambda jobs: Gpu.objects.filter(index=0).update(health=Gpu.Health.OUT_OF_SERVICE),
    "a GPU's metrics": lambda jobs: Gpu.objects.filter(index=1).update(last_metrics={"sm_util": 1}),
    "a class's price, its name written unchanged": _class_repriced,
}


@pytest.mark.parametrize("write", UNSHOWN_WRITES)
def test_writes_that_leave_what_a_page_shows_alone_leave_it_kept(write, finished, tenant, api_client_for):
    """The rows of the nodes, GPUs and classes a page names are written often (a heartbeat every few seconds):
    only a change of the names it shows reaches its versions (the database's triggers)."""
    client = api_client_for(tenant)
    kept, _ = get(client)
    with scopes_disabled():
        UNSHOWN_WRITES[write](finished)
    served, ran = get(client)
    assert ran == {"versions"}  # still kept
    assert served == kept == fresh(client)


def test_a_shown_name_changed_or_its_row_deleted_writes_the_names_version(finished):
    """The names' row is written by the rename and delete triggers only: what a page shows of classes, nodes
    and GPUs reaches its versions through it."""
    from scheduler.models import ShownNamesVersion

    def changes() -> int:
        return ShownNamesVersion.objects.get(pk=1).changes

    spare = node_make("node-spare", gpus=1)
    before = changes()
    Node.objects.filter(pk=spare.pk).update(last_heartbeat_at=BASE, name="node-spare")  # name written, unchanged
    assert changes() == before
    Gpu.objects.filter(node=spare).delete()
    assert changes() == before + 1
    Node.objects.filter(pk=spare.pk).delete()
    assert changes() == before + 2
    PriorityClass.objects.create(name="short-lived", rank=5).delete()
    assert changes() == before + 3


def test_a_job_written_with_its_allocation_is_written_once(finished, tenant):
    """The allocations' trigger gives a job a new row version only when its transaction has not written
    the job yet (a pass updates the jobs it places, then inserts their allocations): one version, not two."""
    job, gpu = finished[0], Gpu.objects.get(index=2)

    def ctid() -> str:  # where the job's current row version is: a new version moves it
        with connection.cursor() as cursor:
            cursor.execute("SELECT ctid::text FROM scheduler_job WHERE id = %s", [job.pk])
            return cursor.fetchone()[0]

    def place() -> tuple[str, str]:
        before = ctid()
        Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=125)
        return before, ctid()

    with transaction.atomic(), scopes_disabled():
        Job.objects.filter(pk=job.pk).update(state=JobState.SCHEDULED)
        written, after = place()
    assert after == written  # the job's row as this transaction wrote it: no second version
    with transaction.atomic(), scopes_disabled():
        untouched, after = place()
    assert after != untouched  # not written in this transaction: the allocation gave it a new version


def test_a_new_job_and_the_job_past_the_pages_end_change_the_page(finished, tenant, api_client_for):
    client = api_client_for(tenant)
    url = "/api/v1/jobs/?page_size=3"
    page, _ = get(client, url)
    older, _ = get(client, page["next"])
    assert older["next"] is None and len(older["results"]) == 3
    assert get(client, page["next"])[1] == {"versions"}
    # The row past the end decides the next link: one more job at the end of the history...
    with scopes_disabled():
        Job.objects.filter(pk=finished[0].pk).update(submitted_at=BASE - timedelta(days=1))
        extra = job_make(tenant, name="oldest")
        Job.objects.filter(pk=extra.pk).update(state=JobState.CANCELLED, submitted_at=BASE - timedelta(days=2))
    older, _ = get(client, page["next"])
    assert older["next"] is not None and older == fresh(client, page["next"])
    # ...and a new one at the top moves every page's window.
    top, _ = get(client, url)
    with scopes_disabled():
        newest = job_make(tenant, name="newest")
        Job.objects.filter(pk=newest.pk).update(state=JobState.CANCELLED)
    served, ran = get(client, url)
    assert "page" in ran and served["results"][0]["id"] == newest.pk and served != top


def test_a_job_added_then_removed_again_is_not_shown(finished, tenant, api_client_for):
    client = api_client_for(tenant)
    before, _ = get(client)
    with scopes_disabled():
        added = job_make(tenant, name="short-lived")
        Job.objects.filter(pk=added.pk).update(state=JobState.CANCELLED)
    with_it, _ = get(client)
    assert with_it["results"][0]["id"] == added.pk
    with scopes_disabled():
        Job.objects.filter(pk=added.pk).delete()
    served, _ = get(client)
    assert served == before == fresh(client)


def test_a_page_showing_a_queued_job_is_never_kept(finished, tenant, other_tenant, api_client_for):
    client = api_client_for(tenant)
    queued = job_make(tenant, name="waiting", gpu_milli=125, kind="inference")
    body, ran = get(client)
    assert ran == {"page"} and body["results"][0]["queue_position"] == 1
    ahead = job_make(other_tenant, name="ahead", gpu_milli=125, kind="inference")
    with scopes_disabled():  # another tenant's job is now ahead of ours: our row did not change
        Job.objects.filter(pk=ahead.pk).update(submitted_at=queued.submitted_at - timedelta(seconds=1))
    body, ran = get(client)
    assert ran == {"page"}  # written afresh every time, no versions read
    assert body["results"][0]["queue_position"] == 2


def test_tenants_never_see_each_others_kept_pages(finished, tenant, other_tenant, api_client_for):
    mine, theirs = api_client_for(tenant), api_client_for(other_tenant)
    get(mine)
    assert get(mine)[1] == {"versions"}
    body, ran = get(theirs)  # the same page of another tenant: its own, written for it
    assert ran == {"page"}
    assert [job["name"] for job in body["results"]] == ["theirs"]
    assert {job["id"] for job in get(mine)[0]["results"]} == {job.pk for job in finished}


def test_inside_a_transaction_nothing_is_read_from_or_kept_in_the_cache(finished, tenant):
    from scheduler.api.page_selectors import job_page_rows

    kept_before = len(page_selectors.pages)
    with transaction.atomic(), scopes_disabled():
        rows = job_page_rows(tenant=tenant, direction="n", key=None, size=50)
        Job.objects.filter(pk=finished[5].pk).update(name="first write")
        Job.objects.filter(pk=finished[5].pk).update(name="second write")  # the same row version (this xid)
        again = job_page_rows(tenant=tenant, direction="n", key=None, size=50)
        assert '"name":"second write"' in again[0]["json"] and again != rows
        transaction.set_rollback(True)
    assert len(page_selectors.pages) == kept_before == 0


def test_the_cache_is_bounded_in_bytes():
    rows = [{"id": 1, "submitted_at": BASE, "state": "succeeded", "json": "x" * 1000}]
    cache = PageCache(max_bytes=5000)
    for i in range(10):
        cache.put(i, page_selectors._Kept(b"v", rows))
    assert 1 <= len(cache) <= 4 and cache.get(9) is not None and cache.get(0) is None  # oldest out first
    cache.put("big", page_selectors._Kept(b"v", rows * 10))  # larger than the whole cache: not kept
    assert cache.get("big") is None


def test_requests_for_a_page_at_the_same_time_share_a_read_begun_after_they_asked(finished, tenant, monkeypatch):
    """Requests that ask for a page while its read is in the air wait for it, then share the next read: one
    check (and one page written, when it changed) for all of them, and never the read in the air, begun
    before they asked (it would not show what was written before they asked)."""
    from concurrent.futures import ThreadPoolExecutor

    from scheduler.api.page_selectors import job_page_rows, page_reads

    waiters, key = 5, (tenant.pk, "n", None, 50)
    real_versions, real_page = page_selectors.job_page_versions, page_selectors.job_page_json
    in_air, release, runs = threading.Event(), threading.Event(), {"versions": 0, "page": 0}

    def versions(**kwargs):
        runs["versions"] += 1
        if runs["versions"] == 1:
            read = real_versions(**kwargs)  # its snapshot: before the rename below
            in_air.set()
            assert release.wait(10)
            return read
        # The other requests have joined this read's flight.
        wait_for(lambda: page_reads.waiting(key) == waiters - 1, timeout=10, interval=0.001)
        return real_versions(**kwargs)

    def page(**kwargs):
        runs["page"] += 1
        return real_page(**kwargs)

    def rows():
        try:
            return job_page_rows(tenant=tenant.pk, direction="n", key=None, size=50)
        finally:
            connection.close()  # this thread's own connection

    rows()  # the page is kept
    monkeypatch.setattr(page_selectors, "job_page_versions", versions)
    monkeypatch.setattr(page_selectors, "job_page_json", page)
    with ThreadPoolExecutor(waiters + 1) as pool:
        first = pool.submit(rows)
        assert in_air.wait(10)
        with scopes_disabled():
            Job.objects.filter(pk=finished[5].pk).update(name="renamed before they asked")
        later = [pool.submit(rows) for _ in range(waiters)]
        wait_for(lambda: page_reads.waiting(key) == waiters, timeout=10, interval=0.001)
        release.set()
        assert '"name":"job 5"' in first.result(10)[0]["json"]  # its read began before the rename
        assert all('"name":"renamed before they asked"' in r.result(10)[0]["json"] for r in later)
    assert runs == {"versions": 2, "page": 1}
