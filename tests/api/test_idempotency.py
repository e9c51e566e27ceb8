"""Idempotency-Key on POST jobs/: one job per key and tenant, whatever the retries."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import requests
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_scopes import scopes_disabled

from accounts.models import TenantQuota
from scheduler.models import Job, JobArray
from tests.factories import TenantFactory, platform_rules_seed, token_for

from .helpers import assert_error

BODY = {"kind": "training", "gpus": 1, "command": ["python", "train.py"], "name": "nightly"}


def _jobs(tenant) -> list[Job]:
    with scopes_disabled():
        return list(Job.objects.filter(tenant=tenant))


@pytest.mark.django_db
def test_same_key_returns_the_original_job(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    first = client.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="ci-run-42")
    assert first.status_code == 201, first.content
    # The same body, keys in another order, sent again (a retry): the same job, 200.
    again = client.post("/api/v1/jobs/", dict(reversed(BODY.items())), format="json", HTTP_IDEMPOTENCY_KEY="ci-run-42")
    assert again.status_code == 200, again.content
    assert again.json()["id"] == first.json()["id"]
    assert len(_jobs(tenant)) == 1
    # Another token of the same tenant with the same key: still the same job.
    other_token = api_client_for(tenant)
    assert other_token.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="ci-run-42").status_code == 200
    # No key: a new job each time.
    assert client.post("/api/v1/jobs/", BODY, format="json").status_code == 201
    assert client.post("/api/v1/jobs/", BODY, format="json").status_code == 201
    assert len(_jobs(tenant)) == 3


@pytest.mark.django_db
def test_same_key_different_body_is_a_conflict(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    assert client.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k1").status_code == 201
    error = assert_error(
        client.post("/api/v1/jobs/", {**BODY, "gpus": 2}, format="json", HTTP_IDEMPOTENCY_KEY="k1"), 409, "conflict"
    )
    assert "k1" in error["message"]
    assert len(_jobs(tenant)) == 1


@pytest.mark.django_db
def test_keys_are_per_tenant(rules, tenant, other_tenant, api_client_for):
    mine = api_client_for(tenant).post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="shared")
    theirs = api_client_for(other_tenant).post(
        "/api/v1/jobs/", {**BODY, "gpus": 2}, format="json", HTTP_IDEMPOTENCY_KEY="shared"
    )
    assert mine.status_code == theirs.status_code == 201
    assert mine.json()["id"] != theirs.json()["id"]


@pytest.mark.django_db
def test_key_expires_after_24_hours(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    old = client.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="daily").json()
    with scopes_disabled():
        Job.objects.filter(pk=old["id"]).update(submitted_at=timezone.now() - timedelta(hours=25))
    new = client.post("/api/v1/jobs/", {**BODY, "gpus": 2}, format="json", HTTP_IDEMPOTENCY_KEY="daily")
    assert new.status_code == 201 and new.json()["id"] != old["id"]


@pytest.mark.django_db
def test_invalid_key_and_invalid_body_create_nothing(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    assert_error(client.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="x" * 256), 400, "invalid")
    assert_error(
        client.post("/api/v1/jobs/", {**BODY, "gpus": 0}, format="json", HTTP_IDEMPOTENCY_KEY="k"),
        400,
        "invalid",
        "gpus",
    )
    assert _jobs(tenant) == []
    # The key was not burnt by the invalid request.
    assert client.post("/api/v1/jobs/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k").status_code == 201


def _statements(client, body: dict, **headers) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        response = client.post("/api/v1/jobs/", body, format="json", **headers)
    assert response.status_code == 201, response.content
    return [q["sql"] for q in queries.captured_queries]


@pytest.mark.django_db
@pytest.mark.parametrize("body", [BODY, {**BODY, "array": {"range": "1-50"}}], ids=["job", "array"])
def test_a_new_key_costs_no_statement_more_than_no_key(rules, tenant, api_client_for, body):
    """The key and digest go into the record's own insert: a CI pipeline's keyed submits (the SDK and the
    CLI always send a key) cost what unkeyed ones do, with no look for the key first and no write after
    (before: a SELECT, an UPDATE and a savepoint's two statements more)."""
    client = api_client_for(tenant)
    for warm in ("warm-1", "warm-2"):  # the statements each connection prepares once
        client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY=warm)
        client.post("/api/v1/jobs/", body, format="json")
    keyed = _statements(client, body, HTTP_IDEMPOTENCY_KEY="ci-run-7")
    plain = _statements(client, body)
    assert len(keyed) == len(plain), (keyed, plain)
    assert not [sql for sql in keyed if "idempotency_key" in sql]
    model = JobArray if "array" in body else Job
    with scopes_disabled():
        assert model.objects.get(tenant=tenant, idempotency_key="ci-run-7").request_hash


@pytest.mark.django_db
@pytest.mark.parametrize("body", [BODY, {**BODY, "array": {"count": 3}}], ids=["job", "array"])
def test_a_retry_at_the_limit_its_job_took_gets_its_job_not_a_refusal(rules, tenant, api_client_for, body):
    """The first attempt was admitted and now counts against the limit; its retry (the answer was lost on
    the way back) must get that job, not a refusal for a job it would add. A new key is still refused."""
    with scopes_disabled():
        TenantQuota.objects.create(tenant=tenant, max_open_jobs=3)
    client = api_client_for(tenant)
    if "array" not in body:
        for _ in range(2):
            assert client.post("/api/v1/jobs/", BODY, format="json").status_code == 201
    first = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="at-the-limit")
    assert first.status_code == 201, first.content
    again = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="at-the-limit")
    assert again.status_code == 200, again.content
    assert again.json()["id"] == first.json()["id"]
    assert_error(client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="new"), 403, "quota_exceeded")
    # Refused with a key in use for another body: the key's conflict is the answer.
    other = {**body, "gpus": 2} if "array" not in body else {**body, "array": {"count": 2}}
    assert_error(
        client.post("/api/v1/jobs/", other, format="json", HTTP_IDEMPOTENCY_KEY="at-the-limit"), 409, "conflict"
    )
    with scopes_disabled():
        assert (
            Job.objects.filter(tenant=tenant).count()
            + sum(a.task_count for a in JobArray.objects.filter(tenant=tenant, tasks_made=False))
            == 3
        )


@pytest.mark.django_db
def test_an_expired_array_key_names_a_new_array(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    body = {**BODY, "array": {"count": 2}}
    old = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="nightly-sweep").json()
    with scopes_disabled():
        JobArray.objects.filter(pk=old["id"]).update(submitted_at=timezone.now() - timedelta(hours=25))
    new = client.post("/api/v1/jobs/", {**body, "gpus": 2}, format="json", HTTP_IDEMPOTENCY_KEY="nightly-sweep")
    assert new.status_code == 201 and new.json()["id"] != old["id"]
    with scopes_disabled():
        assert JobArray.objects.get(pk=old["id"]).idempotency_key == ""


def test_concurrent_requests_with_one_key_create_one_job(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="racer")
    headers = {"Authorization": f"Bearer {token_for(tenant)}", "Idempotency-Key": "same-run"}
    barrier = threading.Barrier(8)
    answers: list[tuple[int, int]] = []

    def submit():
        barrier.wait()
        r = requests.post(f"{live_server.url}/api/v1/jobs/", json=BODY, headers=headers, timeout=60)
        answers.append((r.status_code, r.json().get("id")))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(answers) == 8
    assert sorted(code for code, _ in answers) == [200] * 7 + [201], answers
    assert len({job_id for _, job_id in answers}) == 1
    assert len(_jobs(tenant)) == 1


def test_a_request_digest_is_the_one_keys_stored_before_were_checked_against():
    """The digest is part of what a key stores for 24 h: a retry across an upgrade must still match."""
    import hashlib
    import json
    from dataclasses import asdict

    from scheduler.api.idempotency import request_hash
    from scheduler.services import JobSpec

    spec = JobSpec(
        kind="inference", gpu_milli=250, command=["python", "-c", "print(1)"], env={"B": "2", "A": "1"}, name="n"
    )
    before = json.dumps(asdict(spec), sort_keys=True, separators=(",", ":"), default=str)
    assert request_hash(spec) == hashlib.sha256(before.encode()).hexdigest()
    assert request_hash(spec) != request_hash(JobSpec(kind="inference", gpu_milli=250, command=["python"]))
