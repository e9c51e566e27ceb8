"""What the API remembers between requests to save work: the renderer an ``Accept`` header picks
(gpushare.negotiation) and the API root's links (gpushare.routers). Each answer must be the one DRF works out
afresh, for every header, format and host, and a refusal is never remembered as an answer. (Asked of the
invoice list: the job and array lists' plain JSON calls skip negotiation altogether, gpushare/lean.py.)"""

from __future__ import annotations

import pytest

from accounts.services import ALL_SCOPES
from gpushare import negotiation
from gpushare.routers import ApiRootView

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def forget():
    negotiation._answers.clear()
    ApiRootView._links.clear()


ASKS = [
    ({}, "application/json"),
    ({"HTTP_ACCEPT": "application/json"}, "application/json"),
    ({"HTTP_ACCEPT": "text/html"}, "text/html"),
    ({"HTTP_ACCEPT": "text/html;q=0.5, application/json"}, "application/json"),
    ({"HTTP_ACCEPT": "application/json; indent=4"}, "application/json"),
    ({"HTTP_ACCEPT": "*/*"}, "application/json"),
]


@pytest.mark.parametrize(("headers", "content_type"), ASKS)
def test_a_remembered_answer_is_the_one_worked_out_first(headers, content_type, tenant, api_client_for):
    client = api_client_for(tenant, scopes=ALL_SCOPES)
    first = client.get("/api/v1/invoices/", **headers)
    assert first.status_code == 200 and first["Content-Type"].startswith(content_type)
    assert len(negotiation._answers) == 1
    again = client.get("/api/v1/invoices/", **headers)
    assert again.status_code == 200 and again["Content-Type"] == first["Content-Type"]
    if content_type == "application/json":  # (the browsable page carries a fresh CSRF token each time)
        assert again.content == first.content


def test_each_header_and_format_gets_its_own_answer(tenant, api_client_for):
    client = api_client_for(tenant, scopes=ALL_SCOPES)
    assert client.get("/api/v1/invoices/", HTTP_ACCEPT="application/json")["Content-Type"] == "application/json"
    assert client.get("/api/v1/invoices/", HTTP_ACCEPT="text/html")["Content-Type"].startswith("text/html")
    assert client.get("/api/v1/invoices/?format=json")["Content-Type"] == "application/json"
    assert client.get("/api/v1/invoices/?format=api")["Content-Type"].startswith("text/html")
    pretty = client.get("/api/v1/invoices/", HTTP_ACCEPT="application/json; indent=4")
    assert pretty.content.startswith(b"{\n    ")  # the accepted media type's parameters are kept
    assert len(negotiation._answers) == 5


def test_a_refusal_is_never_remembered(tenant, api_client_for):
    client = api_client_for(tenant, scopes=ALL_SCOPES)
    for _ in range(2):
        assert client.get("/api/v1/invoices/", HTTP_ACCEPT="image/png").status_code == 406
        assert client.get("/api/v1/invoices/?format=xml").status_code == 404
        assert client.get("/api/v1/invoices/?format=json", HTTP_ACCEPT="text/html").status_code == 406
    assert len(negotiation._answers) == 0


def test_the_roots_links_follow_the_host_and_scheme_of_each_request(tenant, api_client_for, settings):
    settings.ALLOWED_HOSTS = ["testserver", "api.example.com"]
    client = api_client_for(tenant, scopes=ALL_SCOPES)
    expected = {
        "jobs": "http://testserver/api/v1/jobs/",
        "arrays": "http://testserver/api/v1/arrays/",
    }
    assert client.get("/api/v1/").json() == expected
    assert client.get("/api/v1/").json() == expected  # remembered
    assert client.get("/api/v1/", HTTP_HOST="api.example.com").json() == {
        key: url.replace("testserver", "api.example.com") for key, url in expected.items()
    }
    assert client.get("/api/v1/", secure=True).json() == {
        key: url.replace("http:", "https:") for key, url in expected.items()
    }
    assert client.get("/api/v1/.json").json() == {key: url.rstrip("/") + ".json" for key, url in expected.items()}
    assert client.get("/api/v1/", HTTP_HOST="evil.example.com").status_code == 400  # never kept for it
    assert len(ApiRootView._links) == 4
