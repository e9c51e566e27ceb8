"""``GET /api/v1/endpoints/?name=``: the exact-match filter the CLI resolves names with."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def deploy(client, name: str) -> dict:
    body = {"name": name, "command": ["python", "serve.py"], "gpus": 0.25}
    response = client.post("/api/v1/endpoints/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_name_matches_exactly_and_only_within_the_tenant(rules, tenant, other_tenant, api_client_for):
    mine, theirs = api_client_for(tenant), api_client_for(other_tenant)
    llm = deploy(mine, "llm")
    deploy(mine, "llm-large")
    their_llm = deploy(theirs, "llm")  # the same name in another tenant
    deploy(theirs, "only-theirs")

    found = mine.get("/api/v1/endpoints/", {"name": "llm"}).json()
    assert [e["id"] for e in found["results"]] == [llm["id"]]
    assert mine.get("/api/v1/endpoints/", {"name": "ll"}).json()["results"] == []  # no prefix or substring match
    assert mine.get("/api/v1/endpoints/", {"name": "LLM"}).json()["results"] == []  # nor case folding
    assert len(mine.get("/api/v1/endpoints/").json()["results"]) == 2  # without the filter: all of mine

    assert mine.get("/api/v1/endpoints/", {"name": "only-theirs"}).json()["results"] == []
    theirs_found = theirs.get("/api/v1/endpoints/", {"name": "llm"}).json()["results"]
    assert [e["id"] for e in theirs_found] == [their_llm["id"]]


def test_a_deleted_endpoint_is_not_found_by_name(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    gone = deploy(client, "old")
    assert client.delete(f"/api/v1/endpoints/{gone['id']}/").status_code == 204
    assert client.get("/api/v1/endpoints/", {"name": "old"}).json()["results"] == []
    again = deploy(client, "old")  # the name is free again
    assert [e["id"] for e in client.get("/api/v1/endpoints/", {"name": "old"}).json()["results"]] == [again["id"]]


@pytest.mark.parametrize("bad", ["no spaces", "a/b", "x\x00y", ""])
def test_a_name_that_cannot_be_an_endpoint_name_is_a_400(rules, tenant, api_client_for, bad):
    response = api_client_for(tenant).get("/api/v1/endpoints/", {"name": bad})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid" and "name" in error["fields"]
