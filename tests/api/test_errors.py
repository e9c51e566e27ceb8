"""One error shape, a stable code, never a 5xx, whatever the input."""

from __future__ import annotations

import json

import pytest
from django.test import RequestFactory
from django_scopes import scopes_disabled

from gpushare.api import server_error
from scheduler.models import Job

from .helpers import assert_error

pytestmark = pytest.mark.django_db

GOOD = {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**GOOD, "kind": "mining"}, "kind"),
        ({**GOOD, "gpus": 0}, "gpus"),
        ({**GOOD, "gpus": -1}, "gpus"),
        ({**GOOD, "gpus": 9}, "gpus"),
        ({**GOOD, "gpus": 1.5}, "gpus"),  # training takes whole GPUs
        ({**GOOD, "gpus": 0.5}, "gpus"),
        ({**GOOD, "kind": "inference", "gpus": 0.3}, "gpus"),
        ({**GOOD, "kind": "inference", "gpus": 0.0625}, "gpus"),
        ({**GOOD, "gpus": "two"}, "gpus"),
        ({**GOOD, "gpus": True}, "gpus"),
        ({**GOOD, "gpus": None}, "gpus"),
        ({**GOOD, "gpus": [1]}, "gpus"),
        ({**GOOD, "gpus": "NaN"}, "gpus"),
        ({**GOOD, "gpus": "Infinity"}, "gpus"),
        ({**GOOD, "gpus": 10**400}, "gpus"),
        ({**GOOD, "gpus": 1e308}, "gpus"),
        ({**GOOD, "command": []}, "command"),
        ({**GOOD, "command": "python train.py"}, "command"),
        ({**GOOD, "command": [{"a": 1}]}, "command"),
        ({**GOOD, "command": ["a\x00b"]}, "command"),
        ({"kind": "training", "gpus": 1}, "command"),
        ({**GOOD, "name": "n" * 201}, "name"),
        ({**GOOD, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
        ({**GOOD, "env": {"A": ["list"]}}, "env"),
        ({**GOOD, "env": "A=1"}, "env"),
        ({**GOOD, "gpu_memory_mb": -5}, "gpu_memory_mb"),
        ({**GOOD, "gpu_memory_mb": 10**30}, "gpu_memory_mb"),
        ({**GOOD, "max_runtime_seconds": 0}, "max_runtime_seconds"),
        ({**GOOD, "max_runtime_seconds": 1.5}, "max_runtime_seconds"),
        ({**GOOD, "priority": "vip-please"}, "priority"),
    ],
)
def test_bad_job_bodies_are_400_invalid(rules, tenant, api_client_for, body, field):
    response = api_client_for(tenant).post("/api/v1/jobs/", json.dumps(body), content_type="application/json")
    assert_error(response, 400, "invalid", field)
    with scopes_disabled():
        assert not Job.objects.exists()


def test_a_nested_fields_error_names_the_place_in_words(rules, tenant, api_client_for):
    """An error inside a list or a map (the command's second word, an env value) reads as a sentence,
    not as the repr of DRF's error objects."""
    body = {**GOOD, "command": ["ok", "a\x00b"], "env": {"A": "b\x00"}}
    error = assert_error(api_client_for(tenant).post("/api/v1/jobs/", body, format="json"), 400, "invalid")
    assert error["fields"]["command"] == ["1: Null characters are not allowed."]
    assert error["fields"]["env"] == ["A: Null characters are not allowed."]
    assert "ErrorDetail" not in json.dumps(error)


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"null", "application/json"),
        (b'{"kind": "training", "gpus": 1, "command": ["\xff\xfe"]}', "application/json"),
        ('{"kind": "training", "gpus": 1, "command": ["é"]}'.encode("utf-16"), "application/json"),
        (b'{"gpus": 1e999999}', "application/json"),
        (b"[" * 100_000, "application/json"),
        (b'{"kind": "training", "gpus": 1, "command": ["x"], "name": "bad\\ud800"}', "application/json"),
        (b'{"kind": "training", "gpus": 1, "command": ["\\udfff"]}', "application/json"),
        (b'{"kind": "training", "gpus": 1, "command": ["x"], "env": {"\\ud800": "x"}}', "application/json"),
    ],
)
def test_malformed_bodies_are_400(rules, tenant, api_client_for, raw, content_type):
    response = api_client_for(tenant).post("/api/v1/jobs/", raw, content_type=content_type)
    assert_error(response, 400, "invalid")


def test_a_form_with_more_fields_than_django_reads_is_400(rules, tenant, api_client_for, settings):
    """Django refuses to read a form past DATA_UPLOAD_MAX_NUMBER_FIELDS (found by schemathesis): a 400
    that says so, not a 500."""
    boundary = "b0undary"
    fields = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1
    raw = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(fields))
    response = api_client_for(tenant).post(
        "/api/v1/jobs/",
        (raw + f"--{boundary}--\r\n").encode(),
        content_type=f"multipart/form-data; boundary={boundary}",
    )
    error = assert_error(response, 400, "invalid")
    assert "DATA_UPLOAD_MAX_NUMBER_FIELDS" in error["message"]


def test_unsupported_media_type_is_415(rules, tenant, api_client_for):
    response = api_client_for(tenant).post("/api/v1/jobs/", b"<job/>", content_type="application/xml")
    assert_error(response, 415, "unsupported_media_type")


def test_oversized_body_is_413(rules, tenant, api_client_for, settings):
    body = json.dumps({**GOOD, "command": ["x" * 8000] * 200})
    assert len(body) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    error = assert_error(
        api_client_for(tenant).post("/api/v1/jobs/", body, content_type="application/json"), 413, "too_large"
    )
    assert str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) in error["message"]


def test_authentication_errors(rules, tenant, client):
    assert_error(client.get("/api/v1/jobs/"), 401, "unauthenticated")
    assert_error(client.get("/api/v1/jobs/", HTTP_AUTHORIZATION="Bearer gps_nope"), 401, "unauthenticated")
    assert_error(client.get("/api/v1/jobs/", HTTP_AUTHORIZATION="Bearer a b"), 401, "unauthenticated")
    assert_error(client.get("/api/v1/jobs/", HTTP_AUTHORIZATION="Bearer \xff\xfe"), 401, "unauthenticated")
    response = client.get("/api/v1/jobs/")
    assert response["WWW-Authenticate"] == "Bearer"


def test_unknown_paths_and_methods(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    assert_error(client.get("/api/v1/nothing-here/"), 404, "not_found")
    assert_error(client.get("/api/v1/jobs/abc/"), 404, "not_found")
    assert_error(client.get("/api/v1/jobs/99999999999999999999999/"), 404, "not_found")
    assert_error(client.get("/api/v1/jobs/%FF%FE/"), 404, "not_found")
    assert_error(client.delete("/api/v1/jobs/"), 405, "method_not_allowed")
    assert_error(client.put("/api/v1/jobs/", GOOD, format="json"), 405, "method_not_allowed")


def test_bad_non_utf8_header_values(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    response = client.post("/api/v1/jobs/", GOOD, format="json", HTTP_IDEMPOTENCY_KEY="clé\xff")
    assert_error(response, 400, "invalid", "Idempotency-Key")


def test_rate_limit_per_token(rules, tenant, api_client_for, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "3/min"}}
    busy, calm = api_client_for(tenant), api_client_for(tenant)
    for _ in range(3):
        assert busy.get("/api/v1/jobs/").status_code == 200
    response = busy.get("/api/v1/jobs/")
    error = assert_error(response, 429, "rate_limited")
    assert 1 <= int(response["Retry-After"]) <= 60
    assert "3/min" in error["message"]
    # Another token (even of the same tenant) has its own allowance.
    assert calm.get("/api/v1/jobs/").status_code == 200


def test_django_level_500_on_api_paths_uses_the_error_shape():
    request = RequestFactory().get("/api/v1/jobs/")
    response = server_error(request)
    assert response.status_code == 500
    assert json.loads(response.content)["error"]["code"] == "server_error"
    html = server_error(RequestFactory().get("/portal/"))
    assert html["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(
    "query",
    [
        "name=%00",
        "name=%FF%FE",
        "state=%00",
        "submitted_after=%00",
        "page=%00",
        "page_size=-1",
        "page=1e9",
        "page_size=99999999999999999999",
    ],
)
def test_odd_query_strings_are_never_a_5xx(rules, tenant, api_client_for, query):
    response = api_client_for(tenant).get(f"/api/v1/jobs/?{query}")
    assert response.status_code in (200, 400, 404), response.content
    if response.status_code != 200:
        assert response.json()["error"]["code"] in ("invalid", "not_found")


@pytest.mark.parametrize("path", ["/api/v1/jobs/%00/", "/api/v1/jobs/1%00/logs/", "/api/v1/jobs/-1/metrics/"])
def test_odd_ids_are_404(rules, tenant, api_client_for, path):
    assert_error(api_client_for(tenant).get(path), 404, "not_found")


def test_nan_and_infinity_literals_are_refused(rules, tenant, api_client_for):
    for raw in (
        b'{"kind": "training", "gpus": NaN, "command": ["x"]}',
        b'{"kind": "training", "gpus": 1, "command": ["x"], "gpu_memory_mb": Infinity}',
    ):
        assert_error(api_client_for(tenant).post("/api/v1/jobs/", raw, content_type="application/json"), 400, "invalid")
