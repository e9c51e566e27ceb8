"""A whole agent process on the fake NVML library: registration, a job metered
from the per-process figures the driver reports, and GPU release only once the
driver shows none of the job's processes."""

from __future__ import annotations

import sys

import pytest
from django_scopes import scopes_disabled

from agents.models import Gpu, Node
from billing.models import UsageWindow
from scheduler.models import Job, JobState
from tests.agents.conftest import GPU0, GPU1, job_dir, wait_output
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

# Prints its pid, then runs until the test removes the flag file... or 60 s.
WAIT_FOR_GO = (
    "import os, sys, time; print('PID=%d' % os.getpid(), flush=True); "
    "deadline = time.time() + 60\n"
    "while not os.path.exists('go') and time.time() < deadline: time.sleep(0.05)\n"
    "time.sleep(1.0)"
)


def test_agent_on_nvml_registers_and_meters_a_job_from_driver_figures(platform, nvml_agent, fake_nvml):
    agent = nvml_agent()
    node = Node.objects.get(name=agent.node)
    assert (node.backend, node.driver_version, node.cuda_version) == ("nvml", "550.54.15", "12.4")
    assert sorted(Gpu.objects.filter(node=node).values_list("uuid", "model", "isolation")) == [
        (GPU0, "H100-80GB", "none"),  # no MPS control program on this host: plain time-slicing
        (GPU1, "H100-80GB", "none"),
    ]

    session = platform.session_for(TenantFactory(slug="acme"))
    body = {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", WAIT_FOR_GO]}
    created = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10).json()
    job_id = created["id"]
    out = wait_output(agent, job_id, "PID=")
    pid = int(out.split("PID=")[1].split()[0])
    with scopes_disabled():
        uuid = wait_for(lambda: Job.objects.get(pk=job_id).allocations.values_list("gpu__uuid", flat=True).first())
    index = [GPU0, GPU1].index(uuid)
    # The driver now sees the job's process: 3000 MiB, 80 % SM.
    fake_nvml.proc_add(index, pid, memory_mb=3000, sm_util=80)
    # ... and a stranger's process on the other GPU, which must not be billed to the job.
    fake_nvml.proc_add(1 - index, 999_999, memory_mb=9000, sm_util=100)
    (job_dir(agent, job_id) / "go").touch()

    # The process exits, but NVML still lists its pid: the GPU is not free, the job not over.
    wait_for(lambda: not _alive(pid), timeout=30, what="the job's process to exit")
    with scopes_disabled():
        assert Job.objects.get(pk=job_id).state == JobState.RUNNING
        fake_nvml.procs = [p for p in fake_nvml.procs if p[1] != pid]
        fake_nvml.save()
        job = wait_for(
            lambda: (j := Job.objects.get(pk=job_id)).state in (JobState.SUCCEEDED, JobState.FAILED) and j,
            timeout=45,
            what="the job to end once NVML no longer lists it",
        )
        assert job.state == JobState.SUCCEEDED, job.stop_reason
        windows = wait_for(lambda: list(UsageWindow.objects.filter(job=job).order_by("seq")), what="windows")
    assert [w.seq for w in windows] == list(range(len(windows)))
    assert max(w.memory_peak_mb for w in windows) == 3000  # its own process only, not the stranger's 9000
    assert sum(w.sm_util_ms for w in windows) > 0
    # Dedicated GPU: the whole device's energy delta (300 W or 100 W, several seconds) is the job's.
    assert sum(w.energy_mj for w in windows) > 100_000


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
