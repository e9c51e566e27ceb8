"""Reads compiled once and run with new values (gpushare.prepared): the job list's page and a job's detail.

The SQL is compiled by whichever request comes first; every later request, of any tenant, runs it with
its own values. These check that what comes back is what the ORM gives, and only the caller's.
"""

from __future__ import annotations

import pytest
from django_scopes import scope

from gpushare.prepared import Prepared
from scheduler.api.views import JOB_DETAIL, JOB_PAGE, _job_page

from .helpers import job_make

pytestmark = pytest.mark.django_db


def ids(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [job["id"] for job in response.json()["results"]]


def walk(client, url: str) -> list[int]:
    """Every id from following ``next`` links from ``url``."""
    seen = []
    while url:
        body = client.get(url).json()
        seen += [job["id"] for job in body["results"]]
        url = body["next"]
    return seen


def test_a_page_compiled_for_one_tenant_shows_the_next_tenant_only_its_own(rules, tenant, other_tenant, api_client_for):
    mine = [job_make(tenant, name=f"a{i}").pk for i in range(3)]
    theirs = [job_make(other_tenant, name=f"b{i}").pk for i in range(5)]
    first, second = api_client_for(tenant), api_client_for(other_tenant)
    assert ids(first.get("/api/v1/jobs/")) == mine[::-1]  # compiles the shape
    assert ids(second.get("/api/v1/jobs/")) == theirs[::-1]
    assert walk(first, "/api/v1/jobs/?page_size=2") == mine[::-1]  # shapes with a cursor too
    assert walk(second, "/api/v1/jobs/?page_size=2") == theirs[::-1]
    # back with 'previous' from the last page
    body = second.get("/api/v1/jobs/?page_size=2").json()
    body = second.get(body["next"]).json()
    back = second.get(body["previous"]).json()
    assert [job["id"] for job in back["results"]] == theirs[::-1][:2]


def test_a_detail_compiled_for_one_tenant_is_404_for_anothers_job(rules, tenant, other_tenant, api_client_for):
    mine, theirs = job_make(tenant), job_make(other_tenant)
    first, second = api_client_for(tenant), api_client_for(other_tenant)
    assert first.get(f"/api/v1/jobs/{mine.pk}/").json()["id"] == mine.pk  # compiles
    assert second.get(f"/api/v1/jobs/{mine.pk}/").status_code == 404
    assert first.get(f"/api/v1/jobs/{theirs.pk}/").status_code == 404
    assert second.get(f"/api/v1/jobs/{theirs.pk}/").json()["id"] == theirs.pk


def test_the_prepared_rows_are_the_orms_rows(rules, tenant, other_tenant):
    jobs = [job_make(tenant, name=f"j{i}", command=["echo", {"k": [i]}]) for i in range(4)]
    job_make(other_tenant)
    key = (jobs[2].submitted_at, jobs[2].pk)
    for direction in ("n", "p"):
        for at_key in (None, key):
            shape = (direction, at_key is not None, 2)
            values = {"at": key[0], "job_id": key[1]} if at_key else {}
            with scope(tenant=tenant.pk):
                expected = list(_job_page(shape, tenant_id=tenant.pk, **values))
            assert JOB_PAGE.rows(shape, tenant_id=tenant.pk, **values) == expected
            assert expected  # the comparison compared something
    with scope(tenant=tenant.pk):
        from scheduler.api.selectors import job_api_rows
        from scheduler.selectors import jobs_for_tenant

        expected = list(job_api_rows(jobs_for_tenant(tenant=tenant.pk), computed=True).filter(pk=jobs[1].pk))
    assert JOB_DETAIL.rows(tenant_id=tenant.pk, job_id=jobs[1].pk) == expected
    assert expected[0]["command"] == ["echo", {"k": [1]}]  # the JSON column decoded as the ORM does


def test_a_value_the_build_does_not_use_is_an_error_not_a_query_without_it(tenant):
    from scheduler.models import Job

    forgetful = Prepared(lambda shape, tenant_id, job_id: Job.objects.filter(tenant=tenant_id).values("id"))
    with pytest.raises(ValueError, match="job_id"):
        forgetful.rows(tenant_id=tenant.pk, job_id=1)
