"""The jobs API's lean dispatch (gpushare/lean.py): plain bearer-token JSON calls skip DRF's per-request
wrapping, and answer exactly as DRF's own dispatch does, refusals included.

Every behaviour below runs down both paths (``path``: ``lean`` as served, ``drf`` with the lean path
switched off), and each run checks which path it took.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.test import Client
from django_scopes import get_scope, scopes_disabled

from accounts.models import ApiToken, Role
from accounts.services import token_create, token_revoke
from gpushare import lean
from gpushare.lean import LeanDispatchMixin
from scheduler.api import views
from tests.factories import member_add

from .helpers import assert_error, job_make

pytestmark = pytest.mark.django_db

GOOD = {"kind": "inference", "gpus": 0.125, "command": ["python", "serve.py"]}
# What may differ between two jobs submitted one after the other.
VOLATILE = {"id", "submitted_at", "queue_position", "estimated_start"}


@pytest.fixture(params=["lean", "drf"])
def path(request, monkeypatch):
    """Which dispatch serves the calls (``taken``: the actions the lean path served)."""
    taken: list[str] = []
    real = LeanDispatchMixin._lean_dispatch

    def spy(self, django_request, action, *rest):
        taken.append(action)
        return real(self, django_request, action, *rest)

    monkeypatch.setattr(LeanDispatchMixin, "_lean_dispatch", spy)
    if request.param == "drf":
        monkeypatch.setattr(lean, "_lean_eligible", lambda _request: False)
    return SimpleNamespace(name=request.param, taken=taken, lean=request.param == "lean")


def _served(path, *actions):
    assert path.taken == (list(actions) if path.lean else []), path.taken


def test_a_submit_and_its_reads_answer_alike_on_both_paths(rules, tenant, api_client_for, path):
    client = api_client_for(tenant)
    created = client.post("/api/v1/jobs/", GOOD, format="json")
    assert created.status_code == 201, created.content
    assert created["Content-Type"] == "application/json"
    assert created["Allow"] == "GET, POST, HEAD, OPTIONS"
    assert created["Vary"] == "Accept"
    body = created.json()
    assert body["state"] == "queued" and body["command"] == GOOD["command"] and body["gpu_uuids"] == []
    detail = client.get(f"/api/v1/jobs/{body['id']}/")
    assert detail.status_code == 200 and detail.json()["id"] == body["id"]
    assert detail["Allow"] == "GET, HEAD, OPTIONS"
    page = client.get("/api/v1/jobs/")
    assert [job["id"] for job in page.json()["results"]] == [body["id"]]
    logs = client.get(f"/api/v1/jobs/{body['id']}/logs/?offset=0")
    assert logs.json() == {"job": body["id"], "offset": 0, "next_offset": 0, "data": "", "complete": False}
    _served(path, "create", "retrieve", "list", "logs")


def test_head_and_options_answer_as_drf_does(rules, tenant, api_client_for, path):
    client = api_client_for(tenant)
    head = client.head("/api/v1/jobs/")
    assert head.status_code == 200 and head["Content-Type"] == "application/json"
    options = client.options("/api/v1/jobs/")  # not a lean action: DRF's metadata
    assert options.status_code == 200 and options.json()["name"]
    _served(path, "list")


def test_the_two_paths_write_the_same_documents(rules, tenant, api_client_for, monkeypatch):
    client = api_client_for(tenant)
    answers = {}
    for name in ("lean", "drf"):
        if name == "drf":
            monkeypatch.setattr(lean, "_lean_eligible", lambda _request: False)
        created = client.post("/api/v1/jobs/", GOOD, format="json")
        job_id = created.json()["id"]
        answers[name] = [
            (created.status_code, {k: v for k, v in created.json().items() if k not in VOLATILE}),
            (200, {k: v for k, v in client.get(f"/api/v1/jobs/{job_id}/").json().items() if k not in VOLATILE}),
        ]
    assert answers["lean"] == answers["drf"]


def test_what_the_lean_path_leaves_to_drf(rules, tenant, api_client_for, path):
    client, plain = api_client_for(tenant), Client()
    assert client.get("/api/v1/jobs/", HTTP_ACCEPT="text/html").status_code == 200  # the browsable API
    pretty = client.get("/api/v1/jobs/", HTTP_ACCEPT="application/json; indent=4")
    assert pretty.status_code == 200 and b"\n    " in pretty.content
    assert client.get("/api/v1/jobs/?format=json").status_code == 200
    assert client.post("/api/v1/jobs/", GOOD).status_code == 201  # a multipart form: DRF parses it
    auth = client._credentials["HTTP_AUTHORIZATION"]
    unsupported = plain.post("/api/v1/jobs/", b"kind=inference", content_type="text/plain", HTTP_AUTHORIZATION=auth)
    assert_error(unsupported, 415, "unsupported_media_type")
    malformed = plain.post("/api/v1/jobs/", GOOD, content_type="application/json", HTTP_AUTHORIZATION=f"{auth} more")
    assert_error(malformed, 401, "unauthenticated")
    assert path.taken == []


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (b'{"kind": "inference", "gpus": 0.3, "command": ["x"]}', "gpus", None),
        (b'{"kind": "inference", "gpus": 0.125}', "command", None),
        (b"", "command", None),
        (b"[1, 2]", None, "Expected a dictionary"),
        (b'{"kind": ', None, "JSON parse error"),
        (b'{"kind": "\\ud800"}', None, "valid Unicode"),
        (b'{"gpus": NaN}', None, "JSON parse error"),
    ],
)
def test_a_bad_body_is_the_same_400(rules, tenant, api_client_for, path, raw, field, message):
    response = api_client_for(tenant).post("/api/v1/jobs/", raw, content_type="application/json")
    error = assert_error(response, 400, "invalid", field)
    if message:
        assert message in error["message"], error
    _served(path, "create")


def test_a_bad_idempotency_key_and_a_replayed_one(rules, tenant, api_client_for, path):
    client = api_client_for(tenant)
    assert_error(
        client.post("/api/v1/jobs/", GOOD, format="json", HTTP_IDEMPOTENCY_KEY="x" * 300),
        400,
        "invalid",
        "Idempotency-Key",
    )
    first = client.post("/api/v1/jobs/", GOOD, format="json", HTTP_IDEMPOTENCY_KEY="ci-run-7")
    again = client.post("/api/v1/jobs/", GOOD, format="json", HTTP_IDEMPOTENCY_KEY="ci-run-7")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    changed = client.post("/api/v1/jobs/", {**GOOD, "name": "other"}, format="json", HTTP_IDEMPOTENCY_KEY="ci-run-7")
    assert_error(changed, 409, "conflict")
    _served(path, "create", "create", "create", "create")


# --- refusals: the lean path lets through nothing DRF's refuses --------------------------------------------


def test_unknown_and_revoked_tokens_are_401_with_the_challenge(rules, tenant, api_client_for, client, path):
    unknown = client.post("/api/v1/jobs/", GOOD, content_type="application/json", HTTP_AUTHORIZATION="Bearer gps_nope")
    assert_error(unknown, 401, "unauthenticated")
    assert unknown["WWW-Authenticate"] == "Bearer"
    user = member_add(tenant, role=Role.MEMBER)
    issued = token_create(tenant=tenant, user=user, name="ci")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {issued.plaintext}"}
    assert client.post("/api/v1/jobs/", GOOD, content_type="application/json", **auth).status_code == 201
    with scopes_disabled():
        token_revoke(token=ApiToken.objects.get(pk=issued.token.pk), actor=None)
    revoked = client.post("/api/v1/jobs/", GOOD, content_type="application/json", **auth)
    assert "revoked" in assert_error(revoked, 401, "unauthenticated")["message"]
    assert revoked["WWW-Authenticate"] == "Bearer"
    _served(path, "create", "create", "create")


def test_scope_and_role_refusals_are_403(rules, tenant, api_client_for, path):
    read_only = api_client_for(tenant, scopes=["jobs:read"])
    error = assert_error(read_only.post("/api/v1/jobs/", GOOD, format="json"), 403, "forbidden")
    assert "jobs:write" in error["message"]
    viewer = api_client_for(tenant, role=Role.VIEWER)
    error = assert_error(viewer.post("/api/v1/jobs/", GOOD, format="json"), 403, "forbidden")
    assert "jobs.submit" in error["message"]
    no_read = api_client_for(tenant, scopes=["jobs:write"])
    assert_error(no_read.get("/api/v1/jobs/"), 403, "forbidden")
    _served(path, "create", "create", "list")


def test_another_tenants_job_is_404_on_every_lean_read(rules, tenant, other_tenant, api_client_for, path):
    theirs = job_make(other_tenant)
    client = api_client_for(tenant)
    assert_error(client.get(f"/api/v1/jobs/{theirs.pk}/"), 404, "not_found")
    assert_error(client.get(f"/api/v1/jobs/{theirs.pk}/logs/"), 404, "not_found")
    assert client.get("/api/v1/jobs/").json()["results"] == []
    _served(path, "retrieve", "logs", "list")


def test_the_rate_limits_answer_429_with_retry_after(rules, tenant, other_tenant, api_client_for, settings, path):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "2/min"}}
    client = api_client_for(tenant)
    for _ in range(2):
        assert client.post("/api/v1/jobs/", GOOD, format="json").status_code == 201
    refused = client.post("/api/v1/jobs/", GOOD, format="json")
    assert "2/min" in assert_error(refused, 429, "rate_limited")["message"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"tenant": "1/min"}}
    other = api_client_for(other_tenant)  # its tenant's count starts here
    assert other.get("/api/v1/jobs/").status_code == 200
    refused = other.get("/api/v1/jobs/")
    assert "api_requests_per_minute=1/min" in assert_error(refused, 429, "rate_limited")["message"]
    _served(path, "create", "create", "create", "list", "list")


def test_a_failing_handler_is_a_500_in_the_error_shape_and_leaves_no_tenant_scope(
    rules, tenant, api_client_for, monkeypatch, path
):
    def broken(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(views, "job_submit_idempotent", broken)
    client = api_client_for(tenant)
    client.raise_request_exception = False
    assert_error(client.post("/api/v1/jobs/", GOOD, format="json"), 500, "server_error")
    assert get_scope() == {}  # no tenant's scope left behind for whatever this thread serves next
    assert client.get("/api/v1/jobs/").status_code == 200
    assert get_scope() == {}
    _served(path, "create", "list")


def test_a_sweeps_polls_of_its_array_answer_alike(rules, tenant, other_tenant, api_client_for, path):
    client = api_client_for(tenant)
    array = client.post("/api/v1/jobs/", {**GOOD, "array": {"count": 3}}, format="json")
    assert array.status_code == 201, array.content
    array_id = array.json()["id"]
    detail = client.get(f"/api/v1/arrays/{array_id}/")
    assert detail.status_code == 200 and detail.json()["states"] == {"queued": 3}
    assert detail["Allow"] == "GET, HEAD, OPTIONS"
    assert [a["id"] for a in client.get("/api/v1/arrays/").json()["results"]] == [array_id]
    assert_error(api_client_for(other_tenant).get(f"/api/v1/arrays/{array_id}/"), 404, "not_found")
    write_only = api_client_for(tenant, scopes=["jobs:write"])
    assert "jobs:read" in assert_error(write_only.get(f"/api/v1/arrays/{array_id}/"), 403, "forbidden")["message"]
    _served(path, "create", "retrieve", "list", "retrieve", "retrieve")
