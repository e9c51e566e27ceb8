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


# --- statements the server plans once per connection (ServerStatement) ------------------------------


@pytest.mark.django_db(transaction=True)  # it closes the connection
def test_a_server_statement_is_prepared_once_per_connection_and_run_with_each_calls_values():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from gpushare.prepared import ServerStatement

    statement = ServerStatement("SELECT %(a)s::integer + %(b)s::integer, %(a)s::integer * 2, '100%%'")
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        statement.execute(cursor, {"a": 2, "b": 3})
        assert cursor.fetchone() == (5, 4, "100%")
        statement.execute(cursor, {"b": 10, "a": 7})  # a name used twice is one parameter
        assert cursor.fetchone() == (17, 14, "100%")
    sent = [q["sql"] for q in queries.captured_queries]
    assert sent[0].startswith(f"PREPARE {statement.name} AS ") and "$1" in sent[0] and "$2" in sent[0]
    assert sent[1:] == [f"EXECUTE {statement.name} (2, 3)", f"EXECUTE {statement.name} (7, 10)"]

    # A new connection has prepared nothing: the statement is prepared there again.
    connection.close()
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        statement.execute(cursor, {"a": 1, "b": 1})
        assert cursor.fetchone() == (2, 2, "100%")
    assert queries.captured_queries[0]["sql"].startswith(f"PREPARE {statement.name} AS ")


def test_a_server_statement_survives_a_rolled_back_transaction():
    """PostgreSQL keeps a prepared statement through a rollback: a submit refused after its first
    statement leaves the connection's statements usable by the next."""
    from django.db import connection, transaction

    from gpushare.prepared import ServerStatement

    statement = ServerStatement("SELECT %s::integer + 1")

    class Refused(Exception):
        pass

    with pytest.raises(Refused), transaction.atomic(), connection.cursor() as cursor:
        statement.execute(cursor, [1])
        raise Refused
    with connection.cursor() as cursor:
        statement.execute(cursor, [41])
        assert cursor.fetchone() == (42,)


def test_a_server_statement_runs_its_one_generic_plan_from_the_first_call(tenant):
    """The platform's connections keep one plan per prepared statement from its first run
    (``plan_cache_mode``): left to PostgreSQL's own rule, each of a connection's first five runs is planned
    again for its values, which made an array submit's EXECUTE 1.2-1.4 ms instead of 0.6 (session 29).
    A plan made for the values shows them; the generic plan shows ``$1``."""
    from django.db import connection

    from gpushare.prepared import ServerStatement

    statement = ServerStatement("SELECT id FROM accounts_tenant WHERE id = %s")
    with connection.cursor() as cursor:
        statement.execute(cursor, [tenant.pk])
        assert cursor.fetchone() == (tenant.pk,)
        cursor.execute(f"EXPLAIN EXECUTE {statement.name} ({int(tenant.pk)})")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "$1" in plan, plan


def test_server_statements_off_run_the_text_as_is(settings):
    """Behind a pooler in transaction mode (GPUSHARE_DB_SERVER_PREPARED=0) nothing is prepared."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from gpushare.prepared import ServerStatement

    settings.GPUSHARE = {**settings.GPUSHARE, "DB_SERVER_PREPARED": False}
    statement = ServerStatement("SELECT %s::integer * 3")
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        statement.execute(cursor, [5])
        assert cursor.fetchone() == (15,)
    assert [q["sql"] for q in queries.captured_queries] == ["SELECT 5::integer * 3"]


def test_a_statement_mixing_placeholder_kinds_is_refused():
    from gpushare.prepared import ServerStatement

    with pytest.raises(ValueError, match="all %s or all"):
        ServerStatement("SELECT %s, %(a)s")


def test_statements_in_turn_go_in_one_round_trip_and_answer_the_last_ones_rows(settings):
    """``execute_in_turn``: each prepared once, then one ``EXECUTE a; EXECUTE b`` with every value; with
    server-side statements off, each text on its own."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from gpushare.prepared import ServerStatement, execute_in_turn

    first = ServerStatement("SELECT %(a)s::integer")
    second = ServerStatement("SELECT %(a)s::integer + %(b)s::integer, 'x'")
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        execute_in_turn(cursor, [(first, {"a": 1}), (second, {"a": 2, "b": 3})])
        assert cursor.fetchall() == [(5, "x")]
        execute_in_turn(cursor, [(first, {"a": 4}), (second, {"a": 5, "b": 6})])
        assert cursor.fetchall() == [(11, "x")]
    sent = [q["sql"] for q in queries.captured_queries]
    assert sent[0].startswith(f"PREPARE {first.name} AS ") and sent[1].startswith(f"PREPARE {second.name} AS ")
    assert sent[2:] == [
        f"EXECUTE {first.name} (1); EXECUTE {second.name} (2, 3)",
        f"EXECUTE {first.name} (4); EXECUTE {second.name} (5, 6)",
    ]

    settings.GPUSHARE = {**settings.GPUSHARE, "DB_SERVER_PREPARED": False}
    with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
        execute_in_turn(cursor, [(first, {"a": 7}), (second, {"a": 1, "b": 1})])
        assert cursor.fetchall() == [(2, "x")]
    assert [q["sql"] for q in queries.captured_queries] == ["SELECT 7::integer", "SELECT 1::integer + 1::integer, 'x'"]
