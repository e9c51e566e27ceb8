"""The placement score with the real thing (HTTP API, Celery worker, PostgreSQL, Redis, an agent process
with simulated GPUs): `make run`'s fleet, priced as the demo seeds it."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from console.management.commands.seed_demo import prices_ensure
from scheduler.models import Job, JobState
from tests.factories import TenantFactory, wait_for
from tests.scheduler.integration_helpers import models_of, submit

pytestmark = pytest.mark.integration


def test_make_run_fleet_a_quarter_slice_lands_on_an_l4_and_a_two_h100_job_starts_at_once(platform, agent_factory):
    prices_ensure()
    agent_factory("sim-node-1", gpus="sim:2xH100-80GB,2xL4-24GB")  # make run's node
    session = platform.session_for(TenantFactory(slug="acme"))

    replica = submit(platform, session, kind="inference", gpus=0.25)
    wait_for(lambda: models_of(replica), timeout=60, what="the slice to be placed")
    assert models_of(replica) == ["L4-24GB"]

    training = submit(platform, session, kind="training", gpus=2, gpu_model="H100-80GB")
    with scopes_disabled():
        job = wait_for(
            lambda: (j := Job.objects.get(pk=training)).state in (JobState.SCHEDULED, JobState.RUNNING) and j,
            timeout=30,
            what="the 2 x H100 job to start",
        )
    assert models_of(training) == ["H100-80GB", "H100-80GB"]
    assert job.pending_reason == ""
    for job_id in (replica, training):
        session.post(f"{platform.url}/api/v1/jobs/{job_id}/cancel/", timeout=15)
