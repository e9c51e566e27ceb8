"""The WSGI application's two middleware chains (gpushare/lanes.py), called as a server calls it."""

from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.contrib.sessions.middleware import SessionMiddleware
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client, override_settings
from django_scopes import scopes_disabled

from accounts.models import Membership
from gpushare import lanes
from tests.factories import token_for

pytestmark = pytest.mark.django_db


def wsgi_call(app, method: str, path: str, *, body: bytes = b"", **headers) -> tuple[int, dict, bytes]:
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "HTTP_HOST": "testserver",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "CONTENT_LENGTH": str(len(body)),
        "CONTENT_TYPE": "application/json",
        **headers,
    }
    started = {}

    def start_response(status, response_headers, exc_info=None):
        started["status"], started["headers"] = int(status.split()[0]), response_headers

    # As Django's test client does: the test's transaction keeps its connection through the request.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        chunks = app(environ, start_response)
        try:
            content = b"".join(chunks)
        finally:
            chunks.close()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    headers_by_name: dict[str, list[str]] = {}
    for name, value in started["headers"]:
        headers_by_name.setdefault(name.lower(), []).append(value)
    return started["status"], headers_by_name, content


@pytest.fixture
def sessions_seen(monkeypatch):
    """The requests SessionMiddleware saw, in applications built after this fixture."""
    seen = []
    original = SessionMiddleware.process_request

    def spy(self, request):
        seen.append(request.path)
        return original(self, request)

    monkeypatch.setattr(SessionMiddleware, "process_request", spy)
    return seen


def session_cookie(tenant) -> str:
    """A logged-in member's session cookie."""
    token_for(tenant)  # makes a member
    with scopes_disabled():
        user = Membership.objects.filter(tenant=tenant).first().user
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def test_a_bearer_api_call_skips_the_browsers_middleware_and_a_browser_call_does_not(tenant, sessions_seen):
    app = lanes.Lanes()
    token = token_for(tenant)
    status, _, _ = wsgi_call(app, "GET", "/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert status == 200 and sessions_seen == []
    status, _, _ = wsgi_call(app, "GET", "/api/v1/jobs/", HTTP_AUTHORIZATION=f"bEaReR {token}")  # any case
    assert status == 200 and sessions_seen == []
    status, _, _ = wsgi_call(app, "GET", "/api/v1/", HTTP_COOKIE=session_cookie(tenant))
    assert status == 200 and sessions_seen == ["/api/v1/"]  # a browser's call: its session
    wsgi_call(app, "GET", "/accounts/login/", HTTP_AUTHORIZATION=f"Bearer {token}")  # not /api/: the whole chain
    assert sessions_seen == ["/api/v1/", "/accounts/login/"]


def test_a_bearer_response_carries_every_header_the_whole_chain_gives_it(tenant):
    """Security headers, CSP, request id and timing: the same names on both lanes, for a success and errors."""
    app = lanes.Lanes()
    token = token_for(tenant)
    for path, headers in (
        ("/api/v1/jobs/", {"HTTP_AUTHORIZATION": f"Bearer {token}"}),
        ("/api/v1/jobs/", {"HTTP_AUTHORIZATION": "Bearer not-a-token"}),
        ("/api/v1/no-such-thing/", {"HTTP_AUTHORIZATION": f"Bearer {token}"}),
    ):
        lane_status, lane, lane_body = wsgi_call(app, "GET", path, **headers)
        whole_status, whole, whole_body = wsgi_call(app.browser, "GET", path, **headers)
        assert lane_status == whole_status
        assert set(lane) == set(whole), (path, set(lane) ^ set(whole))
        for name in ("x-content-type-options", "x-frame-options", "referrer-policy", "x-request-id", "server-timing"):
            assert name in lane, (path, name)
        assert json.loads(lane_body).keys() == json.loads(whole_body).keys()
    assert lane_status == 404 and json.loads(lane_body)["error"]["code"] == "not_found"


def test_a_bad_token_is_refused_on_the_bearer_lane_even_with_a_valid_session(tenant):
    """The token decides alone: a browser's session cookie beside a bad token does not let the call through."""
    status, _, body = wsgi_call(
        lanes.Lanes(),
        "GET",
        "/api/v1/jobs/",
        HTTP_AUTHORIZATION="Bearer revoked-or-unknown",
        HTTP_COOKIE=session_cookie(tenant),
    )
    assert status == 401 and json.loads(body)["error"]["code"] == "unauthenticated"


def test_the_body_limit_and_csrf_hold_on_their_lanes(tenant):
    app = lanes.Lanes()
    too_big = b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)
    status, _, body = wsgi_call(
        app, "POST", "/api/v1/jobs/", body=too_big, HTTP_AUTHORIZATION=f"Bearer {token_for(tenant)}"
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
    # A session's unsafe call without the CSRF token is still refused (the whole chain, DRF's session check).
    job = json.dumps({"command": ["true"], "gpus": 1}).encode()
    status, _, body = wsgi_call(app, "POST", "/api/v1/jobs/", body=job, HTTP_COOKIE=session_cookie(tenant))
    assert status == 403 and "CSRF" in json.loads(body)["error"]["message"]


def test_a_middleware_named_to_skip_but_not_in_the_list_is_an_error():
    with override_settings(BROWSER_ONLY_MIDDLEWARE=["no.such.Middleware"]):
        with pytest.raises(ValueError, match="no.such.Middleware"):
            lanes.api_middleware()
    assert "django.contrib.sessions.middleware.SessionMiddleware" not in lanes.api_middleware()
    assert lanes.api_middleware() == [m for m in settings.MIDDLEWARE if m not in settings.BROWSER_ONLY_MIDDLEWARE]


def test_the_server_loads_the_lanes():
    from gpushare.wsgi import application

    assert isinstance(application, lanes.Lanes)


@pytest.fixture
def resolves(monkeypatch):
    """The paths Django's URL resolver walked its patterns for (a kept match walks none)."""
    from django.urls import get_resolver
    from django.urls.resolvers import URLResolver

    walked = []
    original = URLResolver.resolve

    def spy(self, path):
        if self is get_resolver():  # the URLconf's root resolver: once per walk (the includes recurse)
            walked.append(path)
        return original(self, path)

    lanes._resolved.clear()
    monkeypatch.setattr(URLResolver, "resolve", spy)
    return walked


def test_a_path_is_resolved_once_and_each_request_gets_its_own_match(rules, tenant, resolves):
    app = lanes.Lanes()
    token = token_for(tenant)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    body = json.dumps({"kind": "inference", "command": ["true"], "gpus": 0.25}).encode()
    ids = [json.loads(wsgi_call(app, "POST", "/api/v1/jobs/", body=body, **auth)[2])["id"] for _ in range(2)]
    for job_id in ids * 2:  # each detail is its own job's: the kept match carries its path's id, no other
        status, _, answer = wsgi_call(app, "GET", f"/api/v1/jobs/{job_id}/", **auth)
        assert status == 200 and json.loads(answer)["id"] == job_id
    assert wsgi_call(app, "GET", "/api/v1/", **auth)[0] == 200
    assert wsgi_call(app, "GET", "/api/v1/", HTTP_COOKIE=session_cookie(tenant))[0] == 200  # the browser lane
    assert sorted(resolves) == sorted(["/api/v1/jobs/", *(f"/api/v1/jobs/{i}/" for i in ids), "/api/v1/"])

    # What one request's middleware or view does to its match's kwargs stays with that request.
    handler, request = app.api, SimpleNamespace(path_info=f"/api/v1/jobs/{ids[0]}/")
    first = handler.resolve_request(request)
    first.kwargs["pk"] = "tampered"
    assert handler.resolve_request(SimpleNamespace(path_info=f"/api/v1/jobs/{ids[0]}/")).kwargs == {"pk": str(ids[0])}


def test_a_path_that_matches_nothing_is_not_kept_and_a_new_urlconf_is_resolved_afresh(tenant, resolves):
    app = lanes.Lanes()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token_for(tenant)}"}
    for _ in range(2):
        status, _, body = wsgi_call(app, "GET", "/api/v1/no-such-thing/", **auth)
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    assert wsgi_call(app, "GET", "/healthz-not-here/")[0] == 404
    assert len(lanes._resolved) == 1  # the API's catch-all matched; the other path matched nothing
    assert wsgi_call(app, "GET", "/bench/bare/")[0] == 404
    with override_settings(ROOT_URLCONF="bench.urls"):  # the bench's URLconf: the bare view is there
        assert wsgi_call(app, "GET", "/bench/bare/")[0] == 200
    assert wsgi_call(app, "GET", "/bench/bare/")[0] == 404  # the URLconf back: its own match, not the bench's
