"""Default limits on every plan: visible on the quota API and page, each refusal a 4xx naming the limit."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from accounts.limits import PLAN_DEFAULTS
from accounts.models import Plan
from accounts.services import quota_set
from scheduler.models import Job, JobLogChunk
from scheduler.services import job_logs_append
from tests.api.helpers import assert_error, job_make, node_make

pytestmark = pytest.mark.django_db

ENDPOINT = {"name": "llm", "command": ["serve"], "gpus": 0.25}
JOB = {"kind": "training", "gpus": 1, "command": ["true"], "max_runtime_seconds": 60}


def test_every_tenant_gets_the_plan_defaults_and_the_quota_api_shows_them(rules, tenant, api_client_for):
    limits = api_client_for(tenant).get("/api/v1/quota/").json()["limits"]
    for name, value in PLAN_DEFAULTS.items():
        assert limits[name] == value, name
    # The default plan overrides a built-in default; a tenant's quota overrides the plan.
    Plan.objects.create(name="default", max_endpoints=3)
    assert api_client_for(tenant).get("/api/v1/quota/").json()["limits"]["max_endpoints"] == 3
    quota_set(tenant=tenant, actor=None, max_endpoints=5)
    body = api_client_for(tenant).get("/api/v1/quota/").json()
    assert body["limits"]["max_endpoints"] == 5 and body["headroom"]["endpoints"] == 5


def test_open_jobs_limit_is_a_403_naming_it(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_open_jobs=2)
    client = api_client_for(tenant)
    for _ in range(2):
        assert client.post("/api/v1/jobs/", JOB, format="json").status_code == 201
    error = assert_error(client.post("/api/v1/jobs/", JOB, format="json"), 403, "quota_exceeded")
    assert "max_open_jobs is 2" in error["message"]


def test_queued_jobs_limit_is_a_403_naming_it(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_queued_jobs=1)
    client = api_client_for(tenant)
    assert client.post("/api/v1/jobs/", JOB, format="json").status_code == 201
    error = assert_error(client.post("/api/v1/jobs/", JOB, format="json"), 403, "quota_exceeded")
    assert "1 queued jobs; the limit max_queued_jobs is 1" in error["message"]
    body = client.get("/api/v1/quota/").json()
    assert body["current"]["queued_jobs"] == 1 and body["headroom"]["queued_jobs"] == 0


def test_queued_jobs_limit_counts_an_arrays_tasks(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_queued_jobs=3)
    client = api_client_for(tenant)
    response = client.post("/api/v1/jobs/", {**JOB, "array": {"range": "0-3"}}, format="json")
    error = assert_error(response, 403, "quota_exceeded")
    assert "the array has 4 tasks" in error["message"] and "max_queued_jobs is 3" in error["message"]


def test_endpoints_limit_is_a_403_naming_it(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_endpoints=1)
    client = api_client_for(tenant)
    assert client.post("/api/v1/endpoints/", ENDPOINT, format="json").status_code == 201
    response = client.post("/api/v1/endpoints/", {**ENDPOINT, "name": "two"}, format="json")
    error = assert_error(response, 403, "quota_exceeded")
    assert "max_endpoints is 1" in error["message"]


def test_replicas_limit_is_a_403_naming_it_on_create_and_update(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_replicas_per_endpoint=2)
    client = api_client_for(tenant)
    response = client.post("/api/v1/endpoints/", {**ENDPOINT, "max_replicas": 3}, format="json")
    error = assert_error(response, 403, "quota_exceeded", "max_replicas")
    assert "max_replicas_per_endpoint is 2" in error["message"]
    created = client.post("/api/v1/endpoints/", {**ENDPOINT, "max_replicas": 2}, format="json").json()
    response = client.patch(f"/api/v1/endpoints/{created['id']}/", {"max_replicas": 4}, format="json")
    assert_error(response, 403, "quota_exceeded", "max_replicas")


def test_a_jobs_log_is_kept_to_the_limit_with_older_output_rotated_off(rules, tenant, api_client_for):
    quota_set(tenant=tenant, actor=None, max_log_bytes_per_job=100)
    node = node_make()
    job = job_make(tenant)
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(node=node)
        offset = 0
        for i in range(10):
            line = f"line {i:02d} ".ljust(40, ".").encode()  # 40 bytes each: 400 in all
            job_logs_append(node=node, job_id=job.pk, offset=offset, data=line)
            offset += len(line)
        kept = JobLogChunk.objects.filter(job=job, offset__gte=0).order_by("offset")
        chunks = list(kept.values_list("offset", "data"))
    assert sum(len(bytes(d)) for _, d in chunks) <= 100
    assert [o for o, _ in chunks] == [320, 360]  # the newest output, whole chunks
    page = api_client_for(tenant).get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert page["data"].startswith("line 08") and "line 09" in page["data"]  # from the oldest output kept
    assert page["next_offset"] == 400


def test_the_portal_quota_card_shows_the_limits(rules, tenant, client):
    from tests.factories import member_add

    client.force_login(member_add(tenant))
    quota_set(tenant=tenant, actor=None, max_queued_jobs=7, max_log_bytes_per_job=8 << 20)
    html = client.get("/").content.decode()
    assert "Queued jobs" in html and "/ 7 jobs" in html
    assert "Open jobs" in html and "Endpoints" in html
    assert "Log kept per job" in html and "8 MiB" in html
    assert "API requests per minute (whole tenant)" in html and "600" in html


def test_the_submit_form_shows_the_hold_and_what_is_left(rules, tenant, client):
    from decimal import Decimal

    from tests.factories import member_add

    client.force_login(member_add(tenant))
    quota_set(tenant=tenant, actor=None, monthly_spend_limit=Decimal("20.00"))
    form = {"kind": "training", "gpus": "1", "command": "python train.py", "max_runtime_seconds": "3600"}
    html = client.post("/jobs/new/check/", form).content.decode()
    assert 'id="hold"' in html and "budget is left" in html and "$20.00" in html and "does not fit" not in html
    html = client.post("/jobs/new/check/", {**form, "gpus": "8", "max_runtime_seconds": "86400"}).content.decode()
    assert "does not fit: it would be refused" in html
