"""Job arrays through the REST API: the grammar, one transaction, admission as a whole, the group
and its tasks, cancel as a group and one by one, tenancy."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_scopes import scopes_disabled

from accounts.models import Plan, Role, TenantQuota
from scheduler.array_services import arrays_waiting_make
from scheduler.arrays import ArrayError, array_parse, range_parse
from scheduler.models import Job, JobArray, JobEvent

from .helpers import assert_error

pytestmark = pytest.mark.django_db

BODY = {"kind": "inference", "gpus": 0.125, "command": ["sh", "-c", "echo $GPUSHARE_ARRAY_INDEX"]}


def tasks_of(array_id: int) -> list[Job]:
    with scopes_disabled():
        return list(Job.objects.filter(array_id=array_id).order_by("array_index"))


@pytest.mark.parametrize(
    "value, indices",
    [
        ({"count": 3}, (0, 1, 2)),
        ({"range": "1-5"}, (1, 2, 3, 4, 5)),
        ({"range": "0-9:3"}, (0, 3, 6, 9)),
        ({"range": "1,3,5-7"}, (1, 3, 5, 6, 7)),
        ({"range": "7"}, (7,)),
        ({"range": "0-9999"}, tuple(range(10_000))),
        ({"range": "3-9:7,1,20-30:5"}, (3, 1, 20, 25, 30)),  # 3-9:7 stops before 9; the order as given
    ],
)
def test_grammar(value, indices):
    spec = array_parse(value)
    assert tuple(spec.indices) == indices
    assert spec.count == len(indices)


@pytest.mark.parametrize(
    "value",
    [
        {"count": 0},
        {"count": True},
        {"count": "3"},
        {"count": 10_001},
        {"range": ""},
        {"range": "5-1"},
        {"range": "1-10:0"},
        {"range": "1-3,2"},
        {"range": "1-10%2"},
        {"range": "a-b"},
        {"range": "0-99999999"},
        {"range": "0-10000"},  # 10,001 tasks, one item
        {"range": "0-4999,5000-10000"},  # 10,001 tasks, two
        {"range": "0-20:5,10"},  # 10 is in 0-20:5 too
        {"range": 5},
        {"count": 2, "range": "1-2"},
        {"size": 3},
        [1, 2],
        "1-10",
    ],
)
def test_grammar_refuses(value):
    with pytest.raises(ArrayError):
        array_parse(value)


def test_range_keeps_its_expression():
    assert range_parse(" 1-3 , 9 ").expression == "1-3,9"


def test_submit_stores_the_array_as_one_record_and_the_scheduler_makes_its_tasks(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    with CaptureQueriesContext(connection) as queries:
        response = client.post("/api/v1/jobs/", {**BODY, "name": "sweep", "array": {"range": "1-1000"}}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["task_count"] == 1000 and body["indices"] == "1-1000" and body["name"] == "sweep"
    assert body["states"] == {"queued": 1000}
    assert body["tasks"] == f"/api/v1/jobs/?array={body['id']}"
    # Like sbatch --array: one record at submit, nothing per task (the insert is a statement prepared once
    # per connection: its text shows only where this connection prepares it).
    assert not [q for q in queries.captured_queries if "INSERT" in q["sql"] and '"scheduler_job" ' in q["sql"]]
    assert len(queries.captured_queries) < 20
    assert tasks_of(body["id"]) == []
    with scopes_disabled():
        assert JobArray.objects.filter(tenant=tenant).count() == 1
    with scopes_disabled():
        array = JobArray.objects.get(pk=body["id"])
    assert not array.tasks_made and array.task_spec["gpu_milli"] == 125
    assert client.get(f"/api/v1/arrays/{body['id']}/").json()["states"] == {"queued": 1000}

    with CaptureQueriesContext(connection) as queries:
        with scopes_disabled():
            assert arrays_waiting_make() == 1000
    tasks = tasks_of(body["id"])
    assert [t.array_index for t in tasks] == list(range(1, 1001))
    assert {(t.state, t.name, t.gpu_milli, t.tenant_id, t.submitted_at) for t in tasks} == {
        ("queued", "sweep", 125, tenant.pk, array.submitted_at)
    }
    assert [t.pk for t in tasks] == sorted(t.pk for t in tasks)  # the index order is the queue order
    with scopes_disabled():
        assert JobEvent.objects.filter(job__array_id=body["id"], to_state="queued").count() == 1000
        array.refresh_from_db()
    assert array.tasks_made and array.task_spec == {}
    # Made in bulk: the number of statements does not grow with the tasks; made once.
    assert len(queries.captured_queries) < 12
    with scopes_disabled():
        assert arrays_waiting_make() == 0
    assert len(tasks_of(body["id"])) == 1000
    assert client.get(f"/api/v1/arrays/{body['id']}/").json()["states"] == {"queued": 1000}


def test_listing_the_tasks_right_after_the_submit_shows_every_task(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"range": "0-9:3"}}, format="json").json()
    page = client.get(f"/api/v1/jobs/?array={array['id']}").json()
    assert sorted(j["array"]["index"] for j in page["results"]) == [0, 3, 6, 9]
    assert {j["state"] for j in page["results"]} == {"queued"}


def test_tasks_are_listed_and_shown_as_jobs_of_the_array(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 3}}, format="json").json()
    client.post("/api/v1/jobs/", BODY, format="json")  # a lone job, not in the array
    page = client.get(f"/api/v1/jobs/?array={array['id']}").json()
    assert sorted(j["array"]["index"] for j in page["results"]) == [0, 1, 2]
    assert {j["array"]["id"] for j in page["results"]} == {array["id"]}
    lone = [j for j in client.get("/api/v1/jobs/").json()["results"] if j["array"] is None]
    assert len(lone) == 1
    assert client.get(f"/api/v1/arrays/{array['id']}/").json()["states"] == {"queued": 3}
    listed = client.get("/api/v1/arrays/").json()
    assert [a["id"] for a in listed["results"]] == [array["id"]] and listed["results"][0]["task_count"] == 3
    assert_error(client.get("/api/v1/jobs/?array=abc"), 400, "invalid", "array")


def test_cancel_the_group_and_one_task(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 4}}, format="json").json()
    client.get(f"/api/v1/jobs/?array={array['id']}")  # the tasks are made by the first look (or the next pass)
    tasks = tasks_of(array["id"])
    one = client.post(f"/api/v1/jobs/{tasks[0].pk}/cancel/")
    assert one.status_code == 202 and one.json()["state"] == "cancelled"
    assert client.get(f"/api/v1/arrays/{array['id']}/").json()["states"] == {"cancelled": 1, "queued": 3}
    group = client.post(f"/api/v1/arrays/{array['id']}/cancel/")
    assert group.status_code == 202 and group.json()["states"] == {"cancelled": 4}
    with scopes_disabled():
        events = JobEvent.objects.filter(job__array_id=array["id"], to_state="cancelled").count()
    assert events == 4
    assert client.post(f"/api/v1/arrays/{array['id']}/cancel/").json()["states"] == {"cancelled": 4}  # twice: same


def test_a_group_cancel_records_each_task_from_the_state_it_left(rules, tenant, api_client_for):
    """Queued and preempted tasks are cancelled at once, each with its finish time, its reason and a
    "cancelled" event from the state it was in; a finished task is left as it ended."""
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 4}}, format="json").json()
    client.get(f"/api/v1/jobs/?array={array['id']}")
    tasks = tasks_of(array["id"])
    with scopes_disabled():
        Job.objects.filter(pk=tasks[1].pk).update(state="preempted")
        Job.objects.filter(pk=tasks[3].pk).update(state="succeeded")
    assert client.post(f"/api/v1/arrays/{array['id']}/cancel/").json()["states"] == {"cancelled": 3, "succeeded": 1}
    with scopes_disabled():
        events = dict(
            JobEvent.objects.filter(job__array_id=array["id"], to_state="cancelled").values_list("job_id", "from_state")
        )
        ended = {t.pk: t for t in tasks_of(array["id"])}
    assert events == {tasks[0].pk: "queued", tasks[1].pk: "preempted", tasks[2].pk: "queued"}
    for pk in events:
        assert ended[pk].finished_at is not None and ended[pk].stop_reason.startswith(f"array {array['id']} cancelled")
    assert ended[tasks[3].pk].state == "succeeded" and ended[tasks[3].pk].finished_at is None


def test_limits_apply_to_the_whole_array(rules, tenant, api_client_for):
    with scopes_disabled():
        TenantQuota.objects.create(tenant=tenant, max_open_jobs=10)
    client = api_client_for(tenant)
    for _ in range(3):
        assert client.post("/api/v1/jobs/", BODY, format="json").status_code == 201
    refused = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 8}}, format="json")
    error = assert_error(refused, 403, "quota_exceeded")
    assert "8 tasks" in error["message"] and "max_open_jobs is 10" in error["message"]
    with scopes_disabled():
        assert not JobArray.objects.filter(tenant=tenant).exists()  # none of it was stored
        assert Job.objects.filter(tenant=tenant).count() == 3
    assert client.post("/api/v1/jobs/", {**BODY, "array": {"count": 7}}, format="json").status_code == 201


def test_size_and_budget_holds_refuse_the_whole_array(rules, tenant, api_client_for):
    with scopes_disabled():
        plan = Plan.objects.create(name="tiny", max_gpus_per_job=1)
        TenantQuota.objects.create(tenant=tenant, plan=plan, monthly_spend_limit=0)
    client = api_client_for(tenant)
    assert_error(client.post("/api/v1/jobs/", {**BODY, "array": {"count": 5}}, format="json"), 403, "budget_exhausted")
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 0


def test_bad_array_is_400(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    for array in ({"count": 0}, {"range": "3-1"}, {"range": "1-4%2"}, "1-3", {"count": 20_000}):
        assert_error(client.post("/api/v1/jobs/", {**BODY, "array": array}, format="json"), 400, "invalid", "array")


def test_idempotent_array_submit(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    body = {**BODY, "array": {"count": 5}}
    first = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="sweep-1")
    again = client.post("/api/v1/jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="sweep-1")
    assert first.status_code == 201 and again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 6}}, format="json", HTTP_IDEMPOTENCY_KEY="sweep-1")
    assert_error(other, 409, "conflict")
    with scopes_disabled():
        assert JobArray.objects.filter(tenant=tenant).count() == 1
        arrays_waiting_make()
        assert Job.objects.filter(tenant=tenant).count() == 5


def test_a_viewer_may_not_submit_or_cancel_an_array(rules, tenant, api_client_for):
    owner = api_client_for(tenant)
    array = owner.post("/api/v1/jobs/", {**BODY, "array": {"count": 2}}, format="json").json()
    viewer = api_client_for(tenant, role=Role.VIEWER)
    assert viewer.post("/api/v1/jobs/", {**BODY, "array": {"count": 2}}, format="json").status_code == 403
    assert viewer.post(f"/api/v1/arrays/{array['id']}/cancel/").status_code == 403
    assert viewer.get(f"/api/v1/arrays/{array['id']}/").status_code == 200


@pytest.mark.parametrize("suffix, method", [("", "get"), ("cancel/", "post")])
def test_another_tenants_array_is_404(rules, tenant, other_tenant, api_client_for, suffix, method):
    theirs = api_client_for(other_tenant).post("/api/v1/jobs/", {**BODY, "array": {"count": 2}}, format="json")
    array_id = theirs.json()["id"]
    client = api_client_for(tenant)
    assert_error(getattr(client, method)(f"/api/v1/arrays/{array_id}/{suffix}"), 404, "not_found")
    assert_error(getattr(client, method)(f"/api/v1/arrays/99999999/{suffix}"), 404, "not_found")
    assert client.get(f"/api/v1/jobs/?array={array_id}").json()["results"] == []
    assert client.get("/api/v1/arrays/").json()["results"] == []
    assert tasks_of(array_id) == []  # another tenant's look made nothing of theirs
    with scopes_disabled():
        assert not JobArray.objects.get(pk=array_id).tasks_made


def test_cancelling_an_array_before_its_tasks_are_made_cancels_every_task(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 3}}, format="json").json()
    cancelled = client.post(f"/api/v1/arrays/{array['id']}/cancel/")
    assert cancelled.status_code == 202 and cancelled.json()["states"] == {"cancelled": 3}
    assert {t.state for t in tasks_of(array["id"])} == {"cancelled"}
    with scopes_disabled():
        assert JobEvent.objects.filter(job__array_id=array["id"], to_state="cancelled").count() == 3
        assert arrays_waiting_make() == 0  # the pass makes nothing more of it


def test_limits_count_the_tasks_not_made_yet(rules, tenant, api_client_for):
    with scopes_disabled():
        TenantQuota.objects.create(tenant=tenant, max_open_jobs=10, max_queued_jobs=9)
    client = api_client_for(tenant)
    assert client.post("/api/v1/jobs/", {**BODY, "array": {"count": 8}}, format="json").status_code == 201
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant).count() == 0  # the 8 tasks are not rows yet
    assert client.post("/api/v1/jobs/", BODY, format="json").status_code == 201
    error = assert_error(client.post("/api/v1/jobs/", BODY, format="json"), 403, "quota_exceeded")
    assert "max_queued_jobs is 9" in error["message"]
    assert_error(client.post("/api/v1/jobs/", {**BODY, "array": {"count": 2}}, format="json"), 403, "quota_exceeded")


def test_money_holds_count_the_tasks_not_made_yet(rules, tenant, api_client_for):
    from admission.selectors import holds_open

    client = api_client_for(tenant)
    with scopes_disabled():
        before = holds_open(tenant)
    array = client.post("/api/v1/jobs/", {**BODY, "array": {"count": 4}}, format="json").json()
    with scopes_disabled():
        waiting = holds_open(tenant)
        arrays_waiting_make()
        made = holds_open(tenant)
    assert tasks_of(array["id"]) and made > before
    assert waiting == made  # the same reservation before and after the tasks exist
