"""The OpenAPI schema and the browsable reference."""

from __future__ import annotations

import pytest
import yaml

pytestmark = pytest.mark.django_db


def test_schema_lists_every_v1_endpoint_with_the_error_shape(client):
    response = client.get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    paths = schema["paths"]
    for path in (
        "/api/v1/jobs/",
        "/api/v1/jobs/{id}/",
        "/api/v1/jobs/{id}/cancel/",
        "/api/v1/jobs/{id}/logs/",
        "/api/v1/jobs/{id}/metrics/",
        "/api/v1/quota/",
        "/api/v1/nodes/",
        "/api/v1/nodes/{name}/cordon/",
    ):
        assert path in paths, sorted(paths)
    submit = paths["/api/v1/jobs/"]["post"]
    assert {"200", "201", "400", "401", "403", "404", "409", "413", "429"} <= set(submit["responses"])
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in submit["parameters"])
    assert schema["components"]["securitySchemes"]["bearerToken"]["scheme"] == "bearer"


def test_docs_pages_are_self_contained(client):
    for url in ("/api/docs/", "/api/docs/try/"):
        response = client.get(url)
        assert response.status_code == 200
        page = response.content.decode()
        assert "/static/drf_spectacular_sidecar/" in page
        assert "cdn.jsdelivr.net" not in page
