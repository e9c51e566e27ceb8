"""The side-by-side benchmark's gpushare client against a live server: what it times is what a CI
pipeline does, through gpushare's own SDK (a key with every submit, connections kept)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django_scopes import scopes_disabled

from bench.side_by_side import Ours
from bench.workload import workload
from scheduler.models import Job, JobArray
from tests.factories import TenantFactory, platform_rules_seed, token_for


@pytest.fixture(autouse=True)
def _generous_rate_limit(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}


def test_the_bench_submits_through_the_sdk_with_a_key_each(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="bench-client")
    ours = Ours(SimpleNamespace(url=live_server.url, tenant_token=token_for(tenant)))
    session: dict = {}
    ids = [ours.submit_one(milli, session) for milli in workload(4)]
    array_id = ours.submit_array(5, 125)
    with scopes_disabled():
        jobs = {job.pk: job for job in Job.objects.filter(tenant=tenant)}
        array = JobArray.objects.get(pk=array_id, tenant=tenant)
    assert sorted(jobs) == sorted(ids)
    assert sorted(job.gpu_milli for job in jobs.values()) == [125, 250, 500, 1000]
    keys = {job.idempotency_key for job in jobs.values()} | {array.idempotency_key}
    assert len(keys) == 5 and all(key.startswith("sdk-") for key in keys)  # the SDK's own, one per submit
    assert array.task_count == 5 and array.indices == "1-5"
    assert len({id(client) for client in session.values()}) == 1  # one client (its pool) per bench client
