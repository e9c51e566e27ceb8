"""The API's orjson renderer writes the document DRF's JSONRenderer writes (gpushare/renderers.py)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.utils.translation import gettext_lazy
from rest_framework.exceptions import ErrorDetail
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.serializer_helpers import ReturnDict, ReturnList

from accounts.services import ALL_SCOPES
from gpushare.renderers import FastJSONRenderer


@dataclasses.dataclass
class Point:
    x: int


DOCUMENTS = [
    {"id": 1, "name": "caf\u00e9 \u2603 \U0001f680", "none": None, "ok": True, "gpus": 0.125, "big": 2**62},
    {"at": datetime(2026, 12, 3, 15, 1, 38, 569000, tzinfo=UTC), "whole": datetime(2026, 12, 3, tzinfo=UTC)},
    {"offset": datetime(2026, 12, 3, 15, 0, tzinfo=timezone(timedelta(hours=2))), "naive": datetime(2026, 1, 2, 3)},
    {"day": date(2026, 12, 3), "span": timedelta(seconds=90), "money": Decimal("0.0123456789")},
    {"lazy": gettext_lazy("Not found."), "detail": ErrorDetail("bad", code="invalid"), "id": uuid.UUID(int=7)},
    {1: "int keys become strings", "nested": [{"a": [1, 2, {"b": ()}]}], "tuple": (1, "x")},
    {"separators": "line\u2028para\u2029end", "quote": 'say "hi"\n\t\\', "ctl": "\x00\x1f"},
    {"paragraph only": "a\u2029b", "dash and quotes": "x\u2014y \u201cz\u201d"},  # E2 80 A9; E2 80 94/9C/9D
    {"other E2 80 characters, no separator": "\u2014\u2026\u2030\u20ac"},
    ReturnDict({"a": 1}, serializer=None),
    ReturnList([{"a": 1}], serializer=None),
    {"huge": 2**70, "float": 1e-05, "neg": -0.0},
    [],
    "just a string",
]


@pytest.mark.parametrize("data", DOCUMENTS, ids=range(len(DOCUMENTS)))
def test_the_same_document_as_drf_writes(data):
    ours = FastJSONRenderer().render(data)
    theirs = JSONRenderer().render(data)
    # Floats may be written differently (1e-5 for 1e-05) but must be the same number; everything else is
    # byte for byte.
    if b"e-" in theirs:
        assert json.loads(ours) == json.loads(theirs)
    else:
        assert ours == theirs


def test_what_drf_cannot_write_it_cannot_either():
    for renderer in (FastJSONRenderer(), JSONRenderer()):
        with pytest.raises(TypeError, match="Point is not JSON serializable"):
            renderer.render({"point": Point(3)})


def test_pretty_printing_is_drfs_own():
    data = {"a": [1, 2]}
    assert FastJSONRenderer().render(data, "application/json; indent=2") == JSONRenderer().render(
        data, "application/json; indent=2"
    )
    assert FastJSONRenderer().render(None) == b""


@pytest.mark.django_db
def test_the_api_answers_through_it(api_client_for, tenant):
    response = api_client_for(tenant, scopes=ALL_SCOPES).get("/api/v1/invoices/")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    assert isinstance(response.accepted_renderer, FastJSONRenderer)
    assert response.json()["results"] == []
    from gpushare import lean  # the jobs' and arrays' plain JSON calls (gpushare/lean.py) write with it too

    assert type(lean._renderer) is FastJSONRenderer


def test_json_text_is_copied_in_as_is_or_decoded_for_drfs_path():
    from gpushare.renderers import JsonText

    data = {"results": JsonText(b'[{"a":1,"s":"x\\u0001\xe2\x80\xa8"}]'), "next": None}
    compact = FastJSONRenderer().render(data)
    assert compact == b'{"results":[{"a":1,"s":"x\\u0001\\u2028"}],"next":null}'  # U+2028 escaped here too
    pretty = FastJSONRenderer().render(data, "application/json; indent=2")
    assert pretty.startswith(b'{\n  "results": [\n') and json.loads(pretty) == json.loads(compact)


BROWSABLE_PATHS = ["/api/v1/jobs/", "/api/v1/jobs/{job}/", "/api/v1/arrays/", "/api/v1/endpoints/", "/api/v1/spend/"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", BROWSABLE_PATHS)
def test_the_browsable_api_renders_inside_the_tenants_scope(path, rules, tenant, other_tenant, api_client_for):
    """The browsable API reads the tenant's rows as it renders (its forms), after the view returned: that
    must happen in the tenant's scope (it was a 500), and show only the tenant's."""
    from tests.api.helpers import job_make

    mine, theirs = job_make(tenant, name="mine-job"), job_make(other_tenant, name="their-job")
    response = api_client_for(tenant, scopes=ALL_SCOPES).get(path.format(job=mine.pk), HTTP_ACCEPT="text/html")
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    assert "their-job" not in page and f"/api/v1/jobs/{theirs.pk}/" not in page
    if "jobs" in path:
        assert "mine-job" in page
