"""The job list and detail as read paths (#19): plain rows, no model instances, positions from the page's span."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_scopes import scopes_disabled

from scheduler.array_services import arrays_waiting_make
from scheduler.models import Allocation, Job, JobState, PriorityClass
from tests.query_counts import statements_besides_auth

from .helpers import assert_error, job_make, node_make

pytestmark = pytest.mark.django_db


def _jobs_in_every_state(tenant, api_client_for) -> None:
    """An array's tasks, a slice, a running job, a failed one that was preempted once (two placements)."""
    client = api_client_for(tenant)
    created = client.post(
        "/api/v1/jobs/", {"kind": "inference", "gpus": 0.25, "command": ["true"], "array": {"count": 2}}, format="json"
    )
    assert created.status_code == 201, created.content
    arrays_waiting_make()  # what the next scheduling pass does first
    job_make(tenant, name="slice", kind="inference", gpu_milli=125)
    node = node_make(gpus=4)
    gpus = list(node.gpus.order_by("index"))
    running, failed = job_make(tenant, name="r", gpu_milli=2000), job_make(tenant, name="f", gpu_milli=2000)
    now = timezone.now()
    with scopes_disabled():
        for gpu in (gpus[1], gpus[0]):
            Allocation.objects.create(tenant=tenant, job=running, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=running.pk).update(
            state=JobState.RUNNING, node=node, started_at=now, isolation="exclusive", estimated_start_at=now
        )
        # Held GPUs 2 and 3 first, then (after a preemption) 0 and 1: the API shows the set released last.
        for gpu, released in ((gpus[2], now - timedelta(hours=1)), (gpus[3], now - timedelta(hours=1))):
            Allocation.objects.create(tenant=tenant, job=failed, gpu=gpu, share_milli=1000, released_at=released)
        for gpu in (gpus[1], gpus[0]):
            Allocation.objects.create(tenant=tenant, job=failed, gpu=gpu, share_milli=1000, released_at=now)
        Job.objects.filter(pk=failed.pk).update(
            state=JobState.FAILED, node=node, started_at=now, finished_at=now, exit_code=3, preemption_count=1,
            cost=Decimal("1.23456789"), gpu_ms=5000, sm_util_ms=2500, memory_peak_mb=10, energy_mj=7_200_000,
        )  # fmt: skip


def test_list_and_detail_show_what_drfs_field_by_field_rendering_shows(rules, tenant, api_client_for):
    """A page is rendered from plain rows (job_body), not through the serializer's fields: each job must
    still be exactly what DRF's own rendering of the model instance gives, and what its detail gives."""
    from scheduler.api.selectors import with_api_fields
    from scheduler.api.serializers import JobSerializer
    from scheduler.selectors import jobs_for_tenant

    _jobs_in_every_state(tenant, api_client_for)
    client = api_client_for(tenant)
    listed = client.get("/api/v1/jobs/").json()["results"]
    with scopes_disabled():
        jobs = with_api_fields(jobs_for_tenant(tenant=tenant))
        reference = {job.pk: JobSerializer(job).fields_representation(job) for job in jobs}
    assert len(listed) == len(reference) == 5
    assert {job["state"] for job in listed} == {"queued", "running", "failed"}
    for job in listed:
        assert job == reference[job["id"]], job["name"]
        assert client.get(f"/api/v1/jobs/{job['id']}/").json() == job, job["name"]
    failed = next(job for job in listed if job["name"] == "f")
    assert failed["gpu_uuids"] == ["GPU-node-1-0", "GPU-node-1-1"] and failed["cost"] == "1.2345678900"
    assert failed["usage"] == {"gpu_seconds": 5.0, "sm_util_avg": 50.0, "memory_peak_mb": 10, "energy_wh": 2.0}
    assert next(job for job in listed if job["name"] == "slice")["gpus"] == 0.125


def test_a_list_page_builds_no_model_instances(rules, tenant, api_client_for):
    """Django's model construction was ~5 ms of a page of 51 jobs (docs/benchmarks.md, session 5)."""
    _jobs_in_every_state(tenant, api_client_for)
    client = api_client_for(tenant)
    client.get("/api/v1/jobs/")  # warm the cached token check
    built = []

    def count(sender, instance, **kwargs):
        built.append(sender.__name__)

    post_init.connect(count)
    try:
        page = client.get("/api/v1/jobs/?page_size=3")
        filtered = client.get("/api/v1/jobs/?state=queued&state=running")
        older = client.get(page.json()["next"])
        detail = client.get(f"/api/v1/jobs/{page.json()['results'][0]['id']}/")
    finally:
        post_init.disconnect(count)
    assert [len(r.json()["results"]) for r in (page, filtered, older)] == [3, 4, 2]
    assert detail.status_code == 200
    assert built == []


def test_queue_positions_on_pages_are_the_places_in_the_whole_queue(rules, tenant, other_tenant, api_client_for):
    """Positions come from the page's own span of the queue (counts ahead of its first job): they must equal
    the place in the whole queue (every tenant's jobs; higher rank first, equal ranks by submission), on every
    page, in the detail, and after jobs ahead leave the queue."""
    twin = PriorityClass.objects.create(name="standard-twin", rank=PriorityClass.objects.get(name="standard").rank)
    mine = []
    for i in range(12):  # the two tenants' jobs interleaved, in three classes of two ranks
        priority = ("standard", "serving", "preemptible")[i % 3]
        mine.append(job_make(tenant, name=f"m{i}", priority=priority))
        job_make(other_tenant, name=f"o{i}", priority=("serving", "standard")[i % 2])
    with scopes_disabled():
        Job.objects.filter(pk__in=[mine[3].pk, mine[6].pk]).update(priority=twin)  # ranks tie with standard
    client = api_client_for(tenant)

    def queue_order() -> list[int]:
        with scopes_disabled():
            queued = Job.objects.filter(state=JobState.QUEUED).select_related("priority")
            return [j.pk for j in sorted(queued, key=lambda j: (-j.priority.rank, j.submitted_at, j.pk))]

    def listed_positions(page_size: int) -> dict[int, int]:
        positions, url = {}, f"/api/v1/jobs/?page_size={page_size}"
        while url:
            page = client.get(url).json()
            positions.update({job["id"]: job["queue_position"] for job in page["results"]})
            url = page["next"]
        return positions

    for page_size in (1, 5, 50):
        order = queue_order()
        assert listed_positions(page_size) == {job.pk: order.index(job.pk) + 1 for job in mine}, page_size
    with scopes_disabled():  # jobs ahead leave the queue: one of ours, one of theirs
        Job.objects.filter(pk=mine[1].pk).update(state=JobState.CANCELLED)
        Job.objects.filter(tenant=other_tenant, name="o1").update(state=JobState.RUNNING)
    order = queue_order()
    expected = {job.pk: order.index(job.pk) + 1 if job.pk != mine[1].pk else None for job in mine}
    assert listed_positions(4) == expected
    queued_only = client.get("/api/v1/jobs/?state=queued&page_size=4").json()["results"]
    assert len(queued_only) == 4
    assert all(job["queue_position"] == expected[job["id"]] for job in queued_only), queued_only
    for job in mine[:4]:
        assert client.get(f"/api/v1/jobs/{job.pk}/").json()["queue_position"] == expected[job.pk]


def test_a_page_costs_the_same_few_queries_however_many_jobs_it_shows(rules, tenant, api_client_for):
    """The page (one query), its GPUs (one), its queued jobs' positions (one): 10 jobs or 40 alike (each
    statement is prepared the first time a connection runs it: not counted)."""
    node = node_make()
    gpu = node.gpus.first()
    client = api_client_for(tenant)
    client.get("/api/v1/jobs/")  # warm the cached token check
    counts = []
    for _ in range(2):
        for i in range(len(counts) * 30, len(counts) * 30 + 10 + len(counts) * 20):
            job = job_make(tenant, name=f"j{i}")
            if i % 2:
                with scopes_disabled():
                    Allocation.objects.create(
                        tenant=tenant, job=job, gpu=gpu, share_milli=125, released_at=timezone.now()
                    )
                    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, node=node)  # fmt: skip
        with CaptureQueriesContext(connection) as queries:
            page = client.get("/api/v1/jobs/?page_size=100").json()["results"]
        assert all(job["gpu_uuids"] == ["GPU-node-1-0"] for job in page if job["state"] == "succeeded")
        run = [sql for sql in statements_besides_auth(queries) if not sql.startswith("PREPARE ")]  # once per connection
        counts.append((len(page), len(run)))
    assert [jobs for jobs, _ in counts] == [10, 40]
    assert counts[0][1] == counts[1][1], counts


@pytest.mark.parametrize("pk", ["abc", "1e3", "-1", "99999999999999999999999", "%C2%B2"])
def test_a_detail_of_an_id_that_is_no_number_is_404(rules, tenant, api_client_for, pk):
    assert_error(api_client_for(tenant).get(f"/api/v1/jobs/{pk}/"), 404, "not_found")
