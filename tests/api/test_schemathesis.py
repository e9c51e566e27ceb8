"""A bounded property-based run of every /api/v1/ operation against the live server.

Schemathesis generates requests from the OpenAPI schema (valid ones, then
schema-breaking ones) and checks each answer: never a 5xx, a status code and
content type the schema documents, a body that matches the schema. Bounded by
``REQUEST_BUDGET`` requests shared by every operation and mode (between
``MIN_EXAMPLES`` and ``MAX_EXAMPLES`` each), so the run stays around a minute as
the API grows.
"""

from __future__ import annotations

import time

import pytest
import redis
import requests
import schemathesis
from django.conf import settings as django_settings
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from accounts.services import ALL_SCOPES
from tests.factories import token_for

from .helpers import job_make, node_make

REQUEST_BUDGET = 500
MIN_EXAMPLES, MAX_EXAMPLES = 5, 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

pytestmark = pytest.mark.integration


def _property(operation, mode, base_url, session, failures, examples: int):
    @hypothesis_settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=base_url, session=session, timeout=30)
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a group of every failure it saw
            found = getattr(exc, "exceptions", (exc,))
            detail = " | ".join(f"{getattr(e, 'title', type(e).__name__)}: {str(e)[:400]}" for e in found)
            failures.append(
                f"{case.method} {case.formatted_path} [{mode}] -> {response.status_code} {response.text[:300]}\n"
                f"    {detail}"
            )
            raise

    return check


def test_no_5xx_and_no_schema_violation(live_server, transactional_db, rules, tenant, api_client_for, settings):
    # Neither the per-token nor the per-tenant rate limit (600/min by default) is what this measures.
    rates = {"token": "100000/min", "tenant": "100000/min"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}
    redis.Redis.from_url(django_settings.REDIS_URL).flushdb()  # this test's scheduling messages pile up there
    node = node_make()
    for i in range(3):
        job_make(tenant, name=f"job-{i}")
    job_make(tenant, kind="inference", gpu_milli=250, name="slice")
    del node
    token = token_for(tenant, scopes=list(ALL_SCOPES))
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"

    raw = SchemaGenerator().get_schema(request=None, public=True)
    schema = schemathesis.openapi.from_dict(raw)
    failures: list[str] = []
    started = time.monotonic()
    selected = [r.ok() for r in schema.get_all_operations() if r.ok().path.startswith("/api/v1/")]
    operations = len(selected)
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    examples = max(MIN_EXAMPLES, min(MAX_EXAMPLES, REQUEST_BUDGET // max(1, operations * len(modes))))
    for operation in selected:
        for mode in modes:
            check = _property(operation, mode, live_server.url, session, failures, examples)
            try:
                check()
            except (Exception, BaseExceptionGroup):  # noqa: BLE001 - recorded above; go on with the others
                pass
    elapsed = time.monotonic() - started
    print(f"schemathesis: {operations} operations x {len(modes)} modes x {examples} examples, {elapsed:.1f}s")
    assert operations >= 5
    assert not failures, "\n\n".join(f[:1500] for f in failures)
