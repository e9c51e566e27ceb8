"""Kicks to workers (the scheduling pass a submit asks for, webhook sends) wait for the response to be
sent, not the client for them (gpushare.after_response)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.test import RequestFactory

from gpushare.after_response import AfterResponseMiddleware, after_response
from scheduler import passes
from tests.factories import token_for


def test_outside_a_request_it_runs_at_once():
    ran = []
    after_response(lambda: ran.append(1))
    assert ran == [1]


def test_in_a_request_it_runs_when_the_response_is_closed_and_one_failure_keeps_no_other(caplog):
    ran = []

    def view(request):
        after_response(lambda: ran.append("first"))
        after_response(lambda: 1 / 0)
        after_response(lambda: ran.append("third"))
        from django.http import HttpResponse

        return HttpResponse(b"ok")

    response = AfterResponseMiddleware(view)(RequestFactory().get("/"))
    assert ran == [] and response.content == b"ok"  # the body is ready; nothing kicked yet
    with caplog.at_level(logging.ERROR, logger="gpushare.after_response"):
        response.close()  # what the WSGI server does once it has written the body
    assert ran == ["first", "third"]
    assert "failed" in caplog.text and "ZeroDivisionError" in caplog.text
    after_response(lambda: ran.append("after"))  # the request is over: at once again
    assert ran[-1] == "after"


def test_a_response_never_closed_leaves_nothing_behind_for_the_next_request():
    ran = []
    middleware = AfterResponseMiddleware(lambda request: after_response(lambda: ran.append(request.path)) or None)
    middleware(RequestFactory().get("/lost"))  # never closed
    assert ran == []
    middleware(RequestFactory().get("/next"))
    assert ran == ["/lost"]  # run as the next request began, not carried into it
    from django.core.signals import request_finished

    request_finished.send(sender=None)
    assert ran == ["/lost", "/next"]


@pytest.mark.django_db(transaction=True)  # the submit commits: its on_commit kick is real
def test_a_submit_asks_for_its_pass_only_once_its_response_is_written(rules, tenant, monkeypatch):
    # A pass an earlier test of this process queued for later "covers" submits: this one must ask Redis.
    monkeypatch.setattr(passes, "_covered_until", 0.0)
    client = passes._redis()
    client.delete(passes.PASS_FLAG_KEY)
    body = json.dumps({"kind": "training", "gpus": 1, "command": ["true"]}).encode()
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/api/v1/jobs/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "HTTP_HOST": "testserver",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_AUTHORIZATION": f"Bearer {token_for(tenant)}",
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }
    started = []
    response = WSGIHandler()(environ, lambda status, headers: started.append(status))
    written = b"".join(response)  # what the server writes to the socket
    assert started == ["201 Created"] and json.loads(written)["state"] == "queued"
    assert not client.exists(passes.PASS_FLAG_KEY)  # the client has its answer; the pass is not asked yet
    response.close()
    assert client.exists(passes.PASS_FLAG_KEY)  # asked (and queued for the worker) once it was sent
