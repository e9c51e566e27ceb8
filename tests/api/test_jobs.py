"""REST v1 jobs: the representation, filters, pagination, cancel, logs, metrics, tenancy."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import Role
from billing.models import UsageWindow
from scheduler.array_services import arrays_waiting_make
from scheduler.models import Allocation, Job, JobLogChunk, JobState

from .helpers import assert_error, job_make, node_make

pytestmark = pytest.mark.django_db

CONTRACT_FIELDS = {
    "id",
    "name",
    "kind",
    "gpus",
    "mode",
    "state",
    "pending_reason",
    "queue_position",
    "estimated_start",
    "node",
    "gpu_uuids",
    "isolation",
    "submitted_at",
    "started_at",
    "finished_at",
    "exit_code",
    "cost",
    "usage",
}


def test_job_shows_every_contract_field(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    response = client.post(
        "/api/v1/jobs/",
        {"name": "train", "kind": "inference", "gpus": 0.25, "command": ["python", "x.py"]},
        format="json",
    )
    assert response.status_code == 201, response.content
    job = response.json()
    assert CONTRACT_FIELDS <= set(job)
    assert job["gpus"] == 0.25 and job["mode"] == "shared" and job["state"] == "queued"
    assert job["queue_position"] == 1
    assert job["estimated_start"] is None and job["node"] is None and job["gpu_uuids"] == []
    assert job["cost"] == "0.0000000000"  # exact, as all API money
    assert job["usage"] == {"gpu_seconds": 0.0, "sm_util_avg": None, "memory_peak_mb": 0, "energy_wh": 0.0}

    with scopes_disabled():
        Job.objects.filter(pk=job["id"]).update(estimated_start_at=timezone.now() + timedelta(minutes=5))
    again = client.get(f"/api/v1/jobs/{job['id']}/").json()
    assert again["estimated_start"] is not None


def test_placed_job_shows_node_gpus_isolation_and_usage(rules, tenant, api_client_for):
    node = node_make()
    job = job_make(tenant, gpu_milli=2000)
    with scopes_disabled():
        # As the scheduling pass does it: one bulk insert.
        Allocation.objects.bulk_create(
            Allocation(tenant=tenant, job=job, gpu=gpu, share_milli=1000) for gpu in node.gpus.all()
        )
        Job.objects.filter(pk=job.pk).update(
            state=JobState.RUNNING,
            node=node,
            isolation="exclusive",
            gpu_ms=10_000,
            sm_util_ms=8_000,
            memory_peak_mb=4000,
            energy_mj=7_200_000,
            cost=Decimal("0.0123456789"),
        )
    body = api_client_for(tenant).get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["node"] == "node-1"
    assert body["gpu_uuids"] == ["GPU-node-1-0", "GPU-node-1-1"]
    assert body["isolation"] == "exclusive"
    assert body["queue_position"] is None
    assert body["cost"] == "0.0123456789"  # exact, never rounded
    # 10 GPU-seconds on 2 GPUs = 5 s held; 8 s of SM time over 2 GPUs x 5 s = 80 %.
    assert body["usage"] == {"gpu_seconds": 10.0, "sm_util_avg": 80.0, "memory_peak_mb": 4000, "energy_wh": 2.0}


def test_queue_position_follows_class_then_submission_order(rules, tenant, api_client_for):
    first = job_make(tenant, name="first", priority="batch") if _has_class("batch") else job_make(tenant, name="first")
    second = job_make(tenant, name="second")
    client = api_client_for(tenant)
    listed = {j["name"]: j["queue_position"] for j in client.get("/api/v1/jobs/").json()["results"]}
    detail = {
        name: client.get(f"/api/v1/jobs/{job.pk}/").json()["queue_position"]
        for name, job in (("first", first), ("second", second))
    }
    assert listed == detail
    assert sorted(listed.values()) == [1, 2]


def _has_class(name):
    from scheduler.models import PriorityClass

    return PriorityClass.objects.filter(name=name).exists()


def test_list_is_paginated_by_cursor(rules, tenant, api_client_for):
    for i in range(5):
        job_make(tenant, name=f"job-{i}")
    client = api_client_for(tenant)
    page1 = client.get("/api/v1/jobs/?page_size=2").json()
    assert set(page1) == {"next", "previous", "results"}  # no count: it was a COUNT(*) over all history
    assert len(page1["results"]) == 2 and page1["previous"] is None
    assert "page_size=2" in page1["next"] and "cursor=" in page1["next"]
    seen, url = [], "/api/v1/jobs/?page_size=2"
    while url:
        page = client.get(url).json()
        seen += [j["name"] for j in page["results"]]
        url = page["next"]
    assert seen == [f"job-{i}" for i in reversed(range(5))]  # newest first, each once
    page2 = client.get(page1["next"]).json()
    back = client.get(page2["previous"]).json()
    assert [j["name"] for j in back["results"]] == [j["name"] for j in page1["results"]]
    assert back["previous"] is None
    assert len(client.get("/api/v1/jobs/?page_size=100000").json()["results"]) == 5


def test_cursor_pages_are_stable_under_inserts(rules, tenant, api_client_for):
    """Jobs submitted while a client pages (newer ones) shift nothing: no job is repeated or skipped."""
    for i in range(6):
        job_make(tenant, name=f"old-{i}")
    client = api_client_for(tenant)
    page1 = client.get("/api/v1/jobs/?page_size=2").json()
    for i in range(3):
        job_make(tenant, name=f"new-{i}")
    seen, url = [j["name"] for j in page1["results"]], page1["next"]
    while url:
        page = client.get(url).json()
        seen += [j["name"] for j in page["results"]]
        url = page["next"]
    assert seen == [f"old-{i}" for i in reversed(range(6))]
    # Jobs with the very same submission time (an array's tasks) are ordered by id and never lost.
    with scopes_disabled():
        Job.objects.filter(tenant=tenant).update(submitted_at=timezone.now())
    seen, url = [], "/api/v1/jobs/?page_size=4"
    while url:
        page = client.get(url).json()
        seen += [j["id"] for j in page["results"]]
        url = page["next"]
    assert seen == sorted(seen, reverse=True) and len(seen) == len(set(seen)) == 9


@pytest.mark.parametrize(
    "query",
    [
        "cursor=garbage",
        "cursor=" + "A" * 300,
        "cursor=eyJkIjoibiJ9",  # {"d":"n"}
        "cursor=eyJkIjoieCIsInQiOiIyMDI2LTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwiaSI6MX0",  # direction x
        "cursor=eyJkIjoibiIsInQiOiJub3QgYSB0aW1lIiwiaSI6MX0",  # not a time
        "cursor=eyJkIjoibiIsInQiOiIyMDI2LTAxLTAxVDAwOjAwOjAwKzAwOjAwIiwiaSI6LTF9",  # id -1
        "cursor=%FF%FE",
        "page=2",
        "page_size=0",
        "page_size=abc",
    ],
)
def test_bad_cursor_is_400_in_the_error_shape(rules, tenant, api_client_for, query):
    job_make(tenant)
    response = api_client_for(tenant).get(f"/api/v1/jobs/?{query}")
    field = query.split("=")[0]
    assert_error(response, 400, "invalid", field)


def test_filters(rules, tenant, api_client_for):
    old = job_make(tenant, name="nightly-train")
    with scopes_disabled():
        Job.objects.filter(pk=old.pk).update(submitted_at=timezone.now() - timedelta(days=3), state=JobState.FAILED)
    job_make(tenant, name="serve", kind="inference", gpu_milli=500)
    job_make(tenant, name="train-2")
    client = api_client_for(tenant)

    def names(query):
        response = client.get(f"/api/v1/jobs/?{query}")
        assert response.status_code == 200, response.content
        return sorted(j["name"] for j in response.json()["results"])

    assert names("kind=inference") == ["serve"]
    assert names("state=failed") == ["nightly-train"]
    assert names("state=queued&state=failed") == ["nightly-train", "serve", "train-2"]
    assert names("name=TRAIN") == ["nightly-train", "train-2"]
    since = (timezone.now() - timedelta(days=1)).isoformat().replace("+00:00", "Z")
    assert names(f"submitted_after={since}") == ["serve", "train-2"]
    assert_error(client.get("/api/v1/jobs/?state=exploded"), 400, "invalid", "state")
    assert_error(client.get("/api/v1/jobs/?kind=mining"), 400, "invalid", "kind")
    assert_error(client.get("/api/v1/jobs/?submitted_after=yesterday"), 400, "invalid", "submitted_after")


def test_list_queries_do_not_grow_with_the_page(rules, tenant, api_client_for, settings):
    """Queued, running and finished jobs on a page: one statement (the page's GPUs and its queued jobs'
    places in it), however many jobs; no COUNT but the queue's; a detail or a log poll is one query.
    (Statements sent as text, to read them: not prepared on the server.)"""
    settings.GPUSHARE = {**settings.GPUSHARE, "DB_SERVER_PREPARED": False}
    node = node_make()
    gpus = list(node.gpus.all())
    for i in range(20):
        job = job_make(tenant, name=f"j{i}")
        if i % 2:
            with scopes_disabled():
                Allocation.objects.create(tenant=tenant, job=job, gpu=gpus[i % 2], share_milli=125)
                Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, node=node)
    client = api_client_for(tenant)
    client.get("/api/v1/jobs/")  # warm the cached token check
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/api/v1/jobs/")
    assert len(response.json()["results"]) == 20
    job_queries = [q["sql"] for q in queries.captured_queries if "scheduler_job" in q["sql"]]
    assert len(job_queries) == 1, job_queries
    # Only what the page shows: never the jobs' environments (tenant secrets), nor the nodes' token hashes.
    assert not re.search(r"\benv\b", job_queries[0]) and "token_hash" not in job_queries[0]
    assert "j.*" not in job_queries[0]
    # No COUNT over the tenant's history: only the queue positions count, and only queued jobs (a partial index).
    counted = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counted == [job_queries[0]], counted
    # Its counts over the queue read queued rows only: the jobs at or after the page's first (from the queue's
    # end), or before it (from its head); the rest are the counts the database keeps.
    assert re.findall(r"SELECT 1 FROM \S+ a WHERE (\S+ = \S+)\s+AND", counted[0]) == ["a.state = 'queued'"] * 2
    with scopes_disabled():
        Job.objects.filter(tenant=tenant, state=JobState.QUEUED).update(state=JobState.SUCCEEDED)
    with CaptureQueriesContext(connection) as finished:
        client.get("/api/v1/jobs/")
    assert len([q for q in finished.captured_queries if "scheduler_job" in q["sql"]]) == 1  # no queued: no ranking
    with scopes_disabled():
        Job.objects.filter(tenant=tenant, state=JobState.SUCCEEDED).update(state=JobState.QUEUED)
    running = [j for j in response.json()["results"] if j["state"] == "running"]
    assert len(running) == 10 and all(len(j["gpu_uuids"]) == 1 for j in running)
    queued = [j for j in response.json()["results"] if j["state"] == "queued"]
    assert sorted(j["queue_position"] for j in queued) == list(range(1, 11))
    with CaptureQueriesContext(connection) as detail:
        assert client.get(f"/api/v1/jobs/{queued[0]['id']}/").status_code == 200
    assert len([q for q in detail.captured_queries if '"scheduler_job"' in q["sql"]]) == 1
    with CaptureQueriesContext(connection) as logs:
        assert client.get(f"/api/v1/jobs/{queued[0]['id']}/logs/").status_code == 200
    assert len([q for q in logs.captured_queries if "scheduler_job" in q["sql"]]) == 1


def test_a_filtered_list_page_is_read_without_sorting_every_match(rules, tenant, api_client_for):
    """?state= is a plain WHERE: no DISTINCT, which would make PostgreSQL compute every matching job's
    GPUs and sort all of them before the page's LIMIT (seconds for a few thousand queued jobs)."""
    job_make(tenant, name="q")
    client = api_client_for(tenant)
    client.get("/api/v1/jobs/?state=queued")  # warm the cached token check
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/api/v1/jobs/?state=queued&state=running")
    assert [j["name"] for j in response.json()["results"]] == ["q"]
    page = [q["sql"] for q in queries.captured_queries if '"scheduler_job"' in q["sql"] and "LIMIT" in q["sql"]]
    assert len(page) == 1 and not page[0].upper().startswith("SELECT DISTINCT"), page


def test_the_platforms_database_sessions_do_not_jit_compile_queries(db):
    """Short OLTP queries whose estimates pass the JIT threshold spent ~200 ms compiling (#19)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        assert cursor.fetchone()[0] == "off"


def test_submit_answers_the_job_as_stored_without_reading_it_back(rules, tenant, api_client_for):
    """The 201 body is built from the job just committed; it must be exactly what a read returns."""
    client = api_client_for(tenant)
    client.post("/api/v1/jobs/", {"kind": "inference", "gpus": 0.25, "command": ["true"]}, format="json")
    body = {"name": "x", "kind": "inference", "gpus": 0.5, "command": ["a", "b"], "env": {"A": "1"}, "image": "img"}
    with CaptureQueriesContext(connection) as queries:
        created = client.post("/api/v1/jobs/", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json() == client.get(f"/api/v1/jobs/{created.json()['id']}/").json()
    assert created.json()["queue_position"] == 2 and created.json()["gpu_uuids"] == []
    job_reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('SELECT "scheduler_job"."id", ')]
    allocation_reads = [q["sql"] for q in queries.captured_queries if 'FROM "scheduler_allocation"' in q["sql"]]
    assert job_reads == [] and allocation_reads == []


def test_cancel_queued_job(rules, tenant, api_client_for):
    job = job_make(tenant)
    response = api_client_for(tenant).post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 202, response.content
    assert response.json()["state"] == "cancelled"
    # Cancelling again changes nothing and is still accepted.
    assert api_client_for(tenant).post(f"/api/v1/jobs/{job.pk}/cancel/").json()["state"] == "cancelled"


def test_viewer_may_read_but_not_submit_or_cancel(rules, tenant, api_client_for):
    job = job_make(tenant)
    viewer = api_client_for(tenant, role=Role.VIEWER)
    assert viewer.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    assert_error(
        viewer.post("/api/v1/jobs/", {"kind": "training", "gpus": 1, "command": ["x"]}, format="json"), 403, "forbidden"
    )
    assert_error(viewer.post(f"/api/v1/jobs/{job.pk}/cancel/"), 403, "forbidden")


def test_token_without_write_scope_cannot_submit(rules, tenant, api_client_for):
    client = api_client_for(tenant, scopes=["jobs:read"])
    error = assert_error(
        client.post("/api/v1/jobs/", {"kind": "training", "gpus": 1, "command": ["x"]}, format="json"), 403, "forbidden"
    )
    assert "jobs:write" in error["message"]


def test_logs_follow_by_offset(rules, tenant, api_client_for):
    job = job_make(tenant)
    with scopes_disabled():
        JobLogChunk.objects.create(tenant=tenant, job=job, offset=0, data=b"hello ")
        JobLogChunk.objects.create(tenant=tenant, job=job, offset=6, data="wörld\n".encode())
    client = api_client_for(tenant)
    first = client.get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert first["data"] == "hello wörld\n" and first["next_offset"] == 13 and first["complete"] is False
    tail = client.get(f"/api/v1/jobs/{job.pk}/logs/?offset=6").json()
    assert tail["data"] == "wörld\n" and tail["offset"] == 6
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(
            state=JobState.SUCCEEDED, finished_at=timezone.now() - timedelta(seconds=10), exit_code=0
        )
    end = client.get(f"/api/v1/jobs/{job.pk}/logs/?offset=13").json()
    assert end == {"job": job.pk, "offset": 13, "next_offset": 13, "data": "", "complete": True}
    for bad in ("-1", "abc", "1e3", "9" * 20, "١٢"):
        assert_error(client.get(f"/api/v1/jobs/{job.pk}/logs/", {"offset": bad}), 400, "invalid", "offset")


def test_metrics_series(rules, tenant, api_client_for):
    node = node_make()
    job = job_make(tenant, gpu_milli=2000)
    with scopes_disabled():
        for seq in range(3):
            start = 1_000_000 + seq * 1000
            UsageWindow.objects.create(
                tenant=tenant,
                job=job,
                node=node,
                seq=seq,
                start_ms=start,
                end_ms=start + 1000,
                gpu_model="H100-80GB",
                mode="dedicated",
                gpu_ms=2000,
                sm_util_ms=1000 * seq,
                memory_avg_mb=100 * (seq + 1),
                memory_peak_mb=150 * (seq + 1),
                energy_mj=300_000,
                amount=0,
            )
    body = api_client_for(tenant).get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert body["job"] == job.pk
    assert [p["start_ms"] for p in body["points"]] == [1_000_000, 1_001_000, 1_002_000]
    assert [p["sm_util_pct"] for p in body["points"]] == [0.0, 50.0, 100.0]  # over 2 GPUs
    assert [p["memory_avg_mb"] for p in body["points"]] == [100, 200, 300]
    assert [p["memory_peak_mb"] for p in body["points"]] == [150, 300, 450]
    assert {p["power_w"] for p in body["points"]} == {300.0}  # 300 J in 1 s


def test_metrics_series_is_bounded(rules, tenant, api_client_for):
    node = node_make()
    job = job_make(tenant)
    with scopes_disabled():
        UsageWindow.objects.bulk_create(
            UsageWindow(
                tenant=tenant,
                job=job,
                node=node,
                seq=seq,
                start_ms=seq * 1000,
                end_ms=seq * 1000 + 1000,
                gpu_model="H100-80GB",
                mode="dedicated",
                gpu_ms=1000,
                sm_util_ms=500,
                memory_avg_mb=10,
                memory_peak_mb=seq,
                energy_mj=100_000,
                amount=0,
            )
            for seq in range(1200)
        )
    body = api_client_for(tenant).get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert 0 < len(body["points"]) <= 500
    assert body["bucket_ms"] >= 2400
    assert sum(p["gpu_seconds"] for p in body["points"]) == pytest.approx(1200)
    assert {p["sm_util_pct"] for p in body["points"]} == {50.0}
    assert max(p["memory_peak_mb"] for p in body["points"]) == 1199


@pytest.mark.parametrize("suffix", ["", "cancel/", "logs/", "metrics/"])
def test_another_tenants_job_is_404(rules, tenant, other_tenant, api_client_for, suffix):
    theirs = job_make(other_tenant)
    client = api_client_for(tenant)
    method = client.post if suffix == "cancel/" else client.get
    assert_error(method(f"/api/v1/jobs/{theirs.pk}/{suffix}"), 404, "not_found")
    assert_error(method(f"/api/v1/jobs/999999999/{suffix}"), 404, "not_found")
    assert client.get("/api/v1/jobs/").json()["results"] == []
    with scopes_disabled():
        assert Job.objects.get(pk=theirs.pk).state == JobState.QUEUED


@pytest.mark.parametrize(
    "value", ["0181-08-06T08:12:15-17:41", "0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00", "2026-13-01"]
)
def test_submitted_after_out_of_range_is_400_not_500(rules, tenant, api_client_for, value):
    response = api_client_for(tenant).get("/api/v1/jobs/", {"submitted_after": value})
    assert response.status_code in (200, 400), response.content
    if response.status_code == 400:
        assert_error(response, 400, "invalid", "submitted_after")


def test_the_fast_representation_is_drfs_own(rules, tenant, api_client_for):
    """JobSerializer builds its dict directly (speed); it must equal DRF's field-by-field rendering."""
    from scheduler.api.selectors import with_api_fields
    from scheduler.api.serializers import JobSerializer
    from scheduler.selectors import jobs_for_tenant

    client = api_client_for(tenant)
    client.post("/api/v1/jobs/", {"kind": "inference", "gpus": 0.25, "command": ["true"], "array": {"count": 2}},
                format="json")  # fmt: skip
    arrays_waiting_make()  # what the next scheduling pass does first
    node = node_make()
    gpu = node.gpus.first()
    running, finished = job_make(tenant, name="r"), job_make(tenant, name="f")
    with scopes_disabled():
        Allocation.objects.create(tenant=tenant, job=running, gpu=gpu, share_milli=1000)
        Job.objects.filter(pk=running.pk).update(state=JobState.RUNNING, node=node, started_at=timezone.now(),
                                                 isolation="exclusive", estimated_start_at=timezone.now())  # fmt: skip
        Job.objects.filter(pk=finished.pk).update(
            state=JobState.FAILED, node=node, started_at=timezone.now(), finished_at=timezone.now(), exit_code=3,
            cost=Decimal("1.23456789"), gpu_ms=5000, sm_util_ms=2500, memory_peak_mb=10, energy_mj=7_200_000,
        )  # fmt: skip
        jobs = list(with_api_fields(jobs_for_tenant(tenant=tenant)))
    assert len(jobs) == 4
    for job in jobs:
        serializer = JobSerializer(job)
        assert serializer.to_representation(job) == serializer.fields_representation(job), job.state
