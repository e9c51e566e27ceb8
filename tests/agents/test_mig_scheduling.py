"""MIG known to the scheduler: an agent on the fake NVML reports its MIG layout at registration, a slice is
placed only where a free instance holds it, one that fits nowhere waits in the queue with the profile it
needs (instead of failing at launch), and takes the instance when the slice holding it exits."""

from __future__ import annotations

import sys

import pytest
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from scheduler.models import Job, JobState
from tests.agents.conftest import GPU0, GPU1, job_dir, wait_output
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

# Prints the MIG instance it was given, then runs until the test drops a "go" file in its directory.
SHOW_AND_WAIT = (
    "import os, time; print('MIG=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''), flush=True); "
    "deadline = time.time() + 60\n"
    "while not os.path.exists('go') and time.time() < deadline: time.sleep(0.05)\n"
)


def submit_slice(platform, session, gpus: float) -> int:
    body = {"kind": "inference", "gpus": gpus, "command": [sys.executable, "-c", SHOW_AND_WAIT]}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=15)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def job(job_id: int) -> Job:
    with scopes_disabled():
        return Job.objects.get(pk=job_id)


def test_mig_layout_fits_waits_with_the_profile_and_frees_on_exit(platform, nvml_agent, fake_nvml):
    fake_nvml.gpus[0].mig = fake_nvml.gpus[1].mig = True
    fake_nvml.migs = [
        (0, "MIG-g0-big", 40192, 2),  # 3g.40gb
        (0, "MIG-g0-small", 9856, 7),  # 1g.10gb
        (1, "MIG-g1-a", 9856, 7),
        (1, "MIG-g1-b", 9856, 8),
    ]
    fake_nvml.save()
    agent = nvml_agent()
    node = Node.objects.get(name=agent.node)
    layout = dict(Gpu.objects.filter(node=node).values_list("uuid", "mig_instances"))
    assert layout[GPU0] == [
        {"uuid": "MIG-g0-small", "memory_mb": 9856, "profile": "1g.10gb"},
        {"uuid": "MIG-g0-big", "memory_mb": 40192, "profile": "3g.40gb"},
    ]
    assert [i["profile"] for i in layout[GPU1]] == ["1g.10gb", "1g.10gb"]

    session = platform.session_for(TenantFactory(slug="acme"))
    # Fits: a half slice needs ~36 GB, which only GPU0's 3g.40gb instance holds.
    first = submit_slice(platform, session, 0.5)
    assert wait_output(agent, first, "MIG=").split("MIG=")[1].split()[0] == "MIG-g0-big"
    # Does not fit: it waits in the queue, saying which instance it waits for, and does not fail.
    second = submit_slice(platform, session, 0.5)
    waiting = wait_for(
        lambda: (j := job(second)).pending_reason.startswith("no free MIG") and j,
        timeout=30,
        what="the second slice to wait for a MIG instance",
    )
    assert waiting.state == JobState.QUEUED
    assert waiting.pending_reason == "no free MIG instance of 3g.40gb or larger"
    # A 1/8 slice still fits a small instance meanwhile.
    small = submit_slice(platform, session, 0.125)
    assert wait_output(agent, small, "MIG=").split("MIG=")[1].split()[0] in ("MIG-g0-small", "MIG-g1-a", "MIG-g1-b")
    assert job(second).state == JobState.QUEUED

    # Frees on exit: the first slice ends, the second takes its instance.
    (job_dir(agent, first) / "go").touch()
    wait_for(lambda: job(first).state == JobState.SUCCEEDED, timeout=45, what="the first slice to end")
    assert wait_output(agent, second, "MIG=", timeout=60).split("MIG=")[1].split()[0] == "MIG-g0-big"
    for job_id in (second, small):
        (job_dir(agent, job_id) / "go").touch()
