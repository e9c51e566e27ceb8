"""The API's contract at its edges: strings for string fields, 413 that every client can read,
every /api/ path in the error shape, a whole finished log in one call, public-only docs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import yaml
from django.utils import timezone
from django_scopes import scopes_disabled

from scheduler.models import Job, JobLogChunk, JobState
from tests.processes import ROOT, _spawn, _stop, process_env

from .helpers import assert_error, job_make

pytestmark = pytest.mark.django_db

GOOD = {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}


# --- a string field gets a string ---------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({**GOOD, "command": [1, 2]}, "command", "item 0 must be a string, not a number"),
        ({**GOOD, "command": ["python", 2.5]}, "command", "item 1 must be a string, not a number"),
        ({**GOOD, "command": ["python", True]}, "command", "item 1 must be a string, not a boolean"),
        ({**GOOD, "command": ["python", None]}, "command", "item 1 must be a string, not null"),
        ({**GOOD, "env": {"A": 1}}, "env", "A must be a string, not a number"),
        ({**GOOD, "env": {"A": "ok", "B": False}}, "env", "B must be a string, not a boolean"),
        ({**GOOD, "name": 5}, "name", "must be a string, not a number"),
        ({**GOOD, "image": 1.0}, "image", "must be a string, not a number"),
        ({**GOOD, "priority": 200}, "priority", "must be a string, not a number"),
        ({**GOOD, "gpu_model": ["H100"]}, "gpu_model", "must be a string, not a list"),
    ],
)
def test_numbers_are_not_strings_in_a_job(rules, tenant, api_client_for, body, field, says):
    response = api_client_for(tenant).post("/api/v1/jobs/", json.dumps(body), content_type="application/json")
    error = assert_error(response, 400, "invalid", field)
    assert says in " ".join(error["fields"][field]), error
    assert says in error["message"]
    with scopes_disabled():
        assert not Job.objects.exists()


def test_numbers_are_not_strings_in_an_endpoint(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    body = {"name": "llm", "command": ["python", 8080], "gpus": 0.25, "env": {"PORT2": 1}, "health_path": 7}
    error = assert_error(client.post("/api/v1/endpoints/", body, format="json"), 400, "invalid", "command")
    assert error["fields"]["command"] == ["item 1 must be a string, not a number (8080)"]
    assert error["fields"]["env"] == ["PORT2 must be a string, not a number (1)"]
    assert error["fields"]["health_path"] == ["must be a string, not a number"]


def test_strings_still_pass(rules, tenant, api_client_for):
    body = {**GOOD, "env": {"A": "1", "EMPTY": ""}, "name": "n", "command": ["python", "-c", "1"]}
    response = api_client_for(tenant).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["command"] == ["python", "-c", "1"]


# --- every /api/ path answers in the error shape --------------------------------------


@pytest.mark.parametrize("debug", [True, False])
def test_unknown_api_paths_are_404_in_the_error_shape_even_with_debug(rules, tenant, api_client_for, settings, debug):
    settings.DEBUG = debug
    client = api_client_for(tenant)
    for path in ("/api/", "/api/v1/", "/api/v2/jobs/", "/api/v1/nothing/here/", "/api/v1/jobs/1/nope/"):
        response = client.get(path)
        if path == "/api/v1/" and response.status_code == 200:
            continue  # DRF's API root lists the endpoints
        assert response["Content-Type"] == "application/json", (path, response.content[:200])
        assert_error(response, 404, "not_found")
    assert_error(client.post("/api/v1/nowhere/", {}, format="json"), 404, "not_found")


def test_a_missing_trailing_slash_is_a_404_that_says_so(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    error = assert_error(client.get("/api/v1/jobs"), 404, "not_found")
    assert "/api/v1/jobs/" in error["message"] and "slash" in error["message"]
    # A POST is not redirected (the body would be lost): same answer.
    assert_error(client.post("/api/v1/jobs", GOOD, format="json"), 404, "not_found")


def test_405_has_its_own_code(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    error = assert_error(client.delete("/api/v1/jobs/"), 405, "method_not_allowed")
    assert "DELETE" in error["message"]
    assert_error(client.patch("/api/v1/quota/", {}, format="json"), 405, "method_not_allowed")


def test_an_unhandled_exception_is_a_500_in_the_error_shape_even_with_debug(
    rules, tenant, api_client_for, settings, monkeypatch
):
    from scheduler.api import views

    settings.DEBUG = True

    def boom(self, request, *args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views.JobViewSet, "list", boom)
    response = api_client_for(tenant).get("/api/v1/jobs/")
    error = assert_error(response, 500, "server_error")
    assert "a bug" not in error["message"]  # no internals in the answer; the log has the traceback
    # ...and the tenant's scope did not outlive the request in this thread (it failed open before).
    from django_scopes.exceptions import ScopeError

    with pytest.raises(ScopeError):
        list(Job.objects.all())


def test_a_csrf_failure_on_an_api_path_is_in_the_error_shape(rules, tenant):
    from django.test import Client

    from tests.factories import member_add

    user = member_add(tenant)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    response = browser.post("/api/v1/nowhere/", "{}", content_type="application/json")
    assert response.status_code == 404  # the catch-all is CSRF-exempt: unknown is unknown
    response = browser.post("/api/v1/jobs/", json.dumps(GOOD), content_type="application/json")
    assert_error(response, 403, "forbidden")


# --- 413 that every client can read ---------------------------------------------------


def raw_post(port: int, size: int, *, path: str = "/api/v1/jobs/", expect_continue: bool = False) -> dict:
    """POST ``size`` bytes as fast as the socket takes them while reading the answer, the way
    ``requests`` does (the whole body first): what came back, and whether the send failed."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n" + ("Expect: 100-continue\r\n" if expect_continue else "") + "\r\n"
    )
    answer = bytearray()
    failures: list[str] = []

    def read():
        try:
            while data := sock.recv(65536):
                answer.extend(data)
                if b"\r\n\r\n" in answer and b"too_large" in answer and answer.rstrip().endswith(b"}}"):
                    return
        except OSError as exc:
            failures.append(f"recv: {exc!r}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    chunk = b" " * (1 << 16)
    try:
        sock.sendall(head.encode())
        while sent < size:
            n = min(len(chunk), size - sent)
            sock.sendall(chunk[:n])
            sent += n
    except OSError as exc:
        failures.append(f"send after {sent} bytes: {exc!r}")
    reader.join(30)
    sock.close()
    text = bytes(answer).decode("latin-1")
    final = text.split("HTTP/1.1 100 Continue\r\n\r\n")[-1]
    status = int(final.split(" ", 2)[1]) if final.startswith("HTTP/") else None
    body = final.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in final else ""
    return {"status": status, "body": body, "failures": failures, "sent": sent}


def assert_413(result: dict, size: int) -> None:
    assert result["failures"] == [], result
    assert result["sent"] == size
    assert result["status"] == 413, result
    assert json.loads(result["body"])["error"]["code"] == "too_large"


def test_oversized_bodies_get_a_413_the_client_can_read_from_the_live_server(live_server):
    port = int(live_server.url.rsplit(":", 1)[1])
    for size in (2 << 20, 64 << 20):
        assert_413(raw_post(port, size), size)


@pytest.fixture
def server_port(transactional_db):
    """The web server as deployed (``gpushare.serve``, threads), on the test database."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "gpushare.serve", "--bind", f"127.0.0.1:{port}", "--workers", "1", "--threads", "4"]
    proc, log_path = _spawn(f"web-{port}", argv, process_env())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-2000:]) from None
            time.sleep(0.2)
    yield port
    _stop(proc)


def test_oversized_bodies_get_a_413_the_client_can_read_from_the_web_server(server_port):
    for size in (2 << 20, 64 << 20, 200 << 20):
        assert_413(raw_post(server_port, size), size)
    assert_413(raw_post(server_port, 8 << 20, expect_continue=True), 8 << 20)


def test_requests_sees_the_413(server_port):
    import requests

    response = requests.post(
        f"http://127.0.0.1:{server_port}/api/v1/jobs/",
        data=b"x" * (50 << 20),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "too_large"


def test_curl_sees_the_413(server_port, tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (30 << 20))
    done = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-H", "Content-Type: application/json"]
        + ["--data-binary", f"@{big}", f"http://127.0.0.1:{server_port}/api/v1/jobs/"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    body, code = done.stdout.rsplit("\n", 1)
    assert code == "413" and json.loads(body)["error"]["code"] == "too_large"


# --- a finished job's whole log in one call ----------------------------------------------


def _finished_job_with_log(tenant, parts: list[bytes], *, ago_s: float = 10) -> Job:
    job = job_make(tenant)
    with scopes_disabled():
        offset = 0
        for part in parts:
            JobLogChunk.objects.create(tenant=tenant, job=job, offset=offset, data=part)
            offset += len(part)
        Job.objects.filter(pk=job.pk).update(
            state=JobState.SUCCEEDED, finished_at=timezone.now() - timedelta(seconds=ago_s), exit_code=0
        )
    return job


def test_reading_a_finished_jobs_whole_log_in_one_call_says_complete(rules, tenant, api_client_for):
    job = _finished_job_with_log(tenant, [b"epoch 1\n", b"epoch 2\n", b"done\n"])
    page = api_client_for(tenant).get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert page["data"] == "epoch 1\nepoch 2\ndone\n"
    assert page["complete"] is True
    assert page["next_offset"] == len(page["data"])


def test_complete_only_once_the_end_is_read(rules, tenant, api_client_for, monkeypatch):
    from scheduler.api import views

    monkeypatch.setattr(views, "MAX_LOG_READ", 6)
    job = _finished_job_with_log(tenant, [b"0123456789"])
    client = api_client_for(tenant)
    first = client.get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert (first["data"], first["complete"]) == ("012345", False)
    second = client.get(f"/api/v1/jobs/{job.pk}/logs/?offset={first['next_offset']}").json()
    assert (second["data"], second["complete"]) == ("6789", True)


def test_not_complete_while_the_job_runs_or_just_ended(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    just_ended = _finished_job_with_log(tenant, [b"tail\n"], ago_s=0)
    assert client.get(f"/api/v1/jobs/{just_ended.pk}/logs/").json()["complete"] is False
    running = job_make(tenant)
    assert client.get(f"/api/v1/jobs/{running.pk}/logs/").json()["complete"] is False
    silent = _finished_job_with_log(tenant, [])
    assert client.get(f"/api/v1/jobs/{silent.pk}/logs/").json() | {"job": 0} == {
        "job": 0,
        "offset": 0,
        "next_offset": 0,
        "data": "",
        "complete": True,
    }


# --- the public reference says nothing internal ---------------------------------------------


def _docstrings() -> list[str]:
    """The docstrings of every view, viewset action and serializer the API is made of."""
    from django.urls import get_resolver
    from rest_framework import serializers

    docs: set[str] = set()

    def walk(patterns):
        for pattern in patterns:
            if hasattr(pattern, "url_patterns"):
                walk(pattern.url_patterns)
                continue
            view = getattr(pattern.callback, "cls", None)
            if view is None:
                continue
            for owner in (view, *(getattr(view, name, None) for name in dir(view))):
                doc = getattr(owner, "__doc__", None)
                if doc and callable(owner) and (getattr(owner, "__module__", None) or "").split(".")[0] in _OURS:
                    docs.add(doc.strip().splitlines()[0])

    walk(get_resolver().url_patterns)
    stack = [serializers.Serializer]
    while stack:
        klass = stack.pop()
        stack += klass.__subclasses__()
        if klass.__module__.split(".")[0] in _OURS and klass.__doc__:
            docs.add(klass.__doc__.strip().splitlines()[0])
        for name, member in vars(klass).items():
            if name.startswith("get_") and callable(member) and member.__doc__:
                docs.add(member.__doc__.strip().splitlines()[0])
    return sorted(d for d in docs if len(d) > 12)


_OURS = {"scheduler", "billing", "agents", "endpoints", "accounts", "gpushare", "webhooks"}


def test_the_public_schema_holds_no_docstring(client):
    text = client.get("/api/schema/").content.decode()
    schema = yaml.safe_load(text)
    flat = json.dumps(schema)
    leaked = [doc for doc in _docstrings() if json.dumps(doc)[1:-1] in flat]
    assert leaked == [], leaked
    for phrase in ("django-scopes", "saves a query", "``", "selector", "fails closed"):
        assert phrase not in flat, phrase
    # What users need is still there.
    assert "Per-job detail of the invoice as CSV." in flat
    assert "Log text from byte `offset`" in flat
