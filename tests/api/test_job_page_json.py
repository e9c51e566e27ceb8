"""A list page written as JSON by PostgreSQL (scheduler.api.page_selectors.job_page_statement) is the document
job_body writes, job for job, key for key and figure for figure, whatever the jobs hold.

The reference is the path every other read takes (plain rows, job_api_rows_complete, job_body); the jobs
are made awkward on purpose: quotes, backslashes, control characters, U+2028, text that looks like the
key the page fills in, timestamps with and without microseconds, GPU sets held and released, usage
figures on the rounding edge.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django_scopes import scope, scopes_disabled

from scheduler.api.page_selectors import job_page_json
from scheduler.api.selectors import job_api_rows, job_api_rows_complete
from scheduler.api.serializers import energy_ten_thousandths, job_body, sm_util_tenths
from scheduler.models import Allocation, Job, JobState
from scheduler.selectors import jobs_for_tenant

from .helpers import job_make, node_make

pytestmark = pytest.mark.django_db

QUEUE_POSITION_NULL = '"queue_position":null'  # what a job's JSON says when it is not queued

AWKWARD = [
    "",
    'say "hi"',
    "back\\slash\\",
    "tab\there\nnewline\r",
    "\x01\x1f\x7f control",
    "line\u2028sep\u2029para",
    "ünïcødé ☃ 𝄞",
    QUEUE_POSITION_NULL,
    '{"queue_position":null}',
    "</script><b>",
]


def reference(tenant, ids: list[int]) -> dict[int, dict]:
    """The jobs as job_body writes them, by id (what the API wrote before the page was PostgreSQL's)."""
    with scope(tenant=tenant.pk):
        rows = list(job_api_rows(jobs_for_tenant(tenant=tenant.pk), computed=False).filter(pk__in=ids))
    return {row["id"]: json.loads(json.dumps(job_body(row))) for row in job_api_rows_complete(rows, tenant=tenant)}


def walk(client, url: str) -> list[dict]:
    jobs = []
    while url:
        response = client.get(url)
        assert response.status_code == 200, response.content[:300]
        body = response.json()
        jobs += body["results"]
        url = body["next"]
    return jobs


@pytest.fixture
def awkward_jobs(rules, tenant, other_tenant):
    """Forty jobs of ``tenant`` in every state, with every awkward value, some holding GPUs; a few of
    ``other_tenant``'s in between."""
    rng = random.Random(19)
    node = node_make("node-a", gpus=4)
    gpus = list(node.gpus.order_by("index"))
    base = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    jobs = []
    for i in range(40):
        name = AWKWARD[i % len(AWKWARD)]
        milli = rng.choice([125, 250, 500, 1000, 2000, 3000])
        command = ["sh", "-c", rng.choice(AWKWARD) or "true", {"k": [i, 1.5, None, True, "\u2028"]}]
        job = job_make(
            tenant, name=name, gpu_milli=milli, kind="training" if milli >= 1000 else "inference", command=command
        )
        jobs.append(job)
        if i % 7 == 3:
            job_make(other_tenant, name=f"theirs {i}")
    states = [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]
    with scopes_disabled():
        for i, job in enumerate(jobs):
            state = states[i % len(states)]
            if state == JobState.QUEUED:
                if i % 2:
                    Job.objects.filter(pk=job.pk).update(
                        pending_reason=AWKWARD[(i + 2) % len(AWKWARD)],
                        estimated_start_at=base + timedelta(seconds=i, microseconds=i * 1001 % 7),
                    )
                continue
            started = base + timedelta(minutes=i, microseconds=0 if i % 3 else 123456)
            finished = started + timedelta(seconds=rng.randint(1, 9000), microseconds=rng.choice([0, 1, 999999]))
            gpu_ms = rng.choice([0, 1, 999, 1000, 1500, 3_600_000, rng.randint(0, 10**9)])
            held = gpu_ms * 1000 // job.gpu_milli * max(1, job.gpu_milli // 1000)
            # sm_util on the half-tenth edge where it can be (an exact .x5 in percent)
            sm_util = (held * (2 * rng.randint(0, 999) + 1)) // 2000 if held and i % 2 else rng.randint(0, held or 1)
            Job.objects.filter(pk=job.pk).update(
                state=state,
                node=node,
                started_at=started,
                finished_at=None if state == JobState.RUNNING else finished,
                exit_code=None if state == JobState.RUNNING else rng.choice([0, 1, -9, 137]),
                stop_reason=AWKWARD[(i + 5) % len(AWKWARD)],
                isolation=rng.choice(["", "exclusive", "mps", "mig", "none"]),
                image=rng.choice(["", "pytorch:2.4", 'weird"image']),
                gpu_model=rng.choice(["", "H100-80GB"]),
                gpu_memory_mb=rng.choice([None, 1, 81559]),
                max_runtime_s=rng.choice([1, 60, 86400]),
                preemption_count=rng.randint(0, 3),
                cost=Decimal(rng.randint(0, 10**12)) / Decimal(10**10),
                gpu_ms=gpu_ms,
                sm_util_ms=sm_util,
                memory_peak_mb=rng.choice([0, 1, 40960]),
                energy_mj=rng.choice([0, 180, 360, 540, 1_800_000, rng.randint(0, 10**12)]),
            )
            count = max(1, job.gpu_milli // 1000)
            share = min(job.gpu_milli, 1000)
            if i % 4 == 1:  # released one set, holds another now
                for gpu in gpus[:count]:
                    Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=share, released_at=started)
                for gpu in gpus[-count:]:
                    Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=min(share, 500))
            elif i % 4 == 2:  # released two sets: the last one shows
                for when, chosen in ((started, gpus[:count]), (finished, gpus[::-1][:count])):
                    for gpu in chosen:
                        Allocation.objects.create(tenant=tenant, job=job, gpu=gpu, share_milli=share, released_at=when)
    return jobs


def test_every_page_both_ways_is_job_bodys_document(awkward_jobs, tenant, api_client_for):
    client = api_client_for(tenant)
    expected = reference(tenant, [job.pk for job in awkward_jobs])
    newest_first = sorted(awkward_jobs, key=lambda job: (job.submitted_at, job.pk), reverse=True)
    for size in (1, 3, 7, 50):
        seen = walk(client, f"/api/v1/jobs/?page_size={size}")
        assert [job["id"] for job in seen] == [job.pk for job in newest_first]  # only the tenant's, in order
        for job in seen:
            assert job == expected[job["id"]], job["id"]
            assert list(job) == list(expected[job["id"]])  # the keys in job_body's order
    # back from the last page with 'previous' links
    body = client.get("/api/v1/jobs/?page_size=6").json()
    while body["next"]:
        body = client.get(body["next"]).json()
    back = []
    while True:
        back = body["results"] + back
        if not body["previous"]:
            break
        body = client.get(body["previous"]).json()
    assert back == [expected[job.pk] for job in newest_first]
    queued = [job for job in back if job["state"] == JobState.QUEUED]
    assert queued and all(isinstance(job["queue_position"], int) for job in queued)  # filled in on the page
    assert any(job["gpu_uuids"] for job in back) and any(job["usage"]["sm_util_avg"] is not None for job in back)
    assert any(QUEUE_POSITION_NULL in (job["name"], job["pending_reason"]) for job in queued)  # not confused


def test_the_pretty_and_browsable_paths_write_the_same_jobs(awkward_jobs, tenant, api_client_for):
    client = api_client_for(tenant)
    plain = client.get("/api/v1/jobs/?page_size=20").json()
    pretty = client.get("/api/v1/jobs/?page_size=20", HTTP_ACCEPT="application/json; indent=4")
    assert pretty.status_code == 200 and b'\n    "results": [' in pretty.content
    assert json.loads(pretty.content) == plain
    browsable = client.get("/api/v1/jobs/?page_size=20", HTTP_ACCEPT="text/html")
    assert browsable.status_code == 200
    assert "queue_position" in browsable.content.decode()


def test_the_sql_page_has_size_plus_one_rows_for_knowing_whether_there_are_more(awkward_jobs, tenant):
    rows = job_page_json(tenant=tenant, direction="n", key=None, size=5).rows
    assert len(rows) == 6
    assert [json.loads(row["json"])["id"] for row in rows] == [row["id"] for row in rows]
    key = (rows[4]["submitted_at"], rows[4]["id"])
    older = job_page_json(tenant=tenant, direction="n", key=key, size=5).rows
    assert older[0]["id"] == rows[5]["id"]
    newer = job_page_json(tenant=tenant, direction="p", key=(older[0]["submitted_at"], older[0]["id"]), size=5).rows
    assert [row["id"] for row in newer[:5]] == [row["id"] for row in rows[:5]][::-1]  # oldest first


@pytest.mark.parametrize(
    ("sm_util_ms", "held_ms", "tenths"),
    [
        (0, 1000, 0),
        (1000, 1000, 1000),
        (9995, 20000, 500),  # 49.975 % -> 50.0 (half up)
        (9994, 20000, 500),  # 49.97 -> 50.0
        (9989, 20000, 499),  # 49.945 -> 49.9 (just under half)
        (1, 3, 333),  # 33.33.. -> 33.3
        (1, 2000, 1),  # 0.05 % -> 0.1 (half up)
        (1, 8000, 0),  # 0.0125 % -> 0.0
        (1, 40000, 0),  # 0.0025 % -> 0.0
    ],
)
def test_sm_util_rounds_half_up_on_the_exact_ratio(sm_util_ms, held_ms, tenths):
    assert sm_util_tenths(sm_util_ms, held_ms) == tenths


@pytest.mark.parametrize(
    ("energy_mj", "ten_thousandths"),
    [(0, 0), (179, 0), (180, 1), (360, 1), (539, 1), (540, 2), (3_600_000, 10000), (3_600_180, 10001)],
)
def test_energy_rounds_half_up_to_a_ten_thousandth_of_a_wh(energy_mj, ten_thousandths):
    assert energy_ten_thousandths(energy_mj) == ten_thousandths
