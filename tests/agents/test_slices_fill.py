"""Eight 1/8 slices share one GPU; a ninth waits (real scheduler, real agent)."""

from __future__ import annotations

import sys

import pytest
from django_scopes import scopes_disabled

from scheduler.models import Job, JobState
from tests.agents.conftest import wait_output
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

SLICE = (
    "import os, time; print('slice=%s on %s' % (os.environ['GPUSHARE_GPU_FRACTION'], "
    "os.environ['CUDA_VISIBLE_DEVICES']), flush=True); time.sleep(90)"
)


def test_eight_eighth_slices_fill_a_gpu_and_a_ninth_waits(platform, agent_factory, node):
    agent = agent_factory(node, gpus="sim:1xL4-24GB")
    session = platform.session_for(TenantFactory(slug="acme"))
    ids = []
    for _ in range(9):
        body = {"kind": "inference", "gpus": 0.125, "command": [sys.executable, "-c", SLICE]}
        response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])

    def states():
        with scopes_disabled():
            return dict(Job.objects.filter(pk__in=ids).values_list("pk", "state"))

    wait_for(lambda: list(states().values()).count(JobState.RUNNING) == 8, timeout=90, what="eight running slices")
    current = states()
    (waiting,) = [pk for pk, state in current.items() if state == JobState.QUEUED]
    with scopes_disabled():
        assert Job.objects.get(pk=waiting).pending_reason
    running = [pk for pk in ids if pk != waiting]
    seen = {wait_output(agent, pk, "slice=").split("slice=")[1].split()[2] for pk in running}
    assert len(seen) == 1 and next(iter(seen)).startswith("GPU-")  # all on the one GPU
    assert all("slice=0.125 on" in wait_output(agent, pk, "slice=") for pk in running)
