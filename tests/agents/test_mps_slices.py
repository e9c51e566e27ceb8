"""Shared slices on an NVML host with MPS: one control daemon per shared GPU,
each client's caps, the daemon stopped with the GPU's last slice, and the
per-job memory total enforced from what NVML reports.

``nvidia-cuda-mps-control`` is a fake on PATH that records how it is called.
"""

from __future__ import annotations

import json
import os
import sys

import psutil
import pytest

from agents.models import Gpu
from tests.agents.conftest import GPU0, GPU1, job_dir, launch_direct, parse_env_dump, wait_output
from tests.factories import wait_for

pytestmark = pytest.mark.integration

FAKE_MPS_CONTROL = """#!/bin/sh
stdin=""
if [ "$1" != "-d" ]; then stdin=$(cat); fi
printf '{"argv": "%s", "gpu": "%s", "pipe": "%s", "log": "%s", "stdin": "%s"}\\n' \\
  "$*" "$CUDA_VISIBLE_DEVICES" "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$stdin" >> "{record}"
"""

HOLD = (
    "import json, os, time; print('ENV=' + json.dumps(dict(os.environ)), flush=True); "
    "print('PID=%d' % os.getpid(), flush=True)\n"
    "while not os.path.exists('go'): time.sleep(0.05)"
)


@pytest.fixture
def mps_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "mps-calls.jsonl"
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE_MPS_CONTROL.replace("{record}", str(record)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_one_daemon_per_shared_gpu_with_client_caps(nvml_agent, mps_control):
    agent = nvml_agent()
    assert set(Gpu.objects.filter(node__name=agent.node).values_list("isolation", flat=True)) == {"mps"}
    launch_direct(agent, 9101, [sys.executable, "-c", HOLD], gpu_uuids=[GPU0], share_milli=125)
    launch_direct(agent, 9102, [sys.executable, "-c", HOLD], gpu_uuids=[GPU0], share_milli=250)
    first = parse_env_dump(wait_output(agent, 9101, "PID="))
    second = parse_env_dump(wait_output(agent, 9102, "PID="))

    calls = mps_control()
    assert [c["argv"] for c in calls] == ["-d"]  # one daemon for the two slices
    daemon = calls[0]
    assert daemon["gpu"] == GPU0
    assert daemon["pipe"] and daemon["log"] and daemon["pipe"] != daemon["log"]
    for env in (first, second):
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon["pipe"]
        assert env["CUDA_MPS_LOG_DIRECTORY"] == daemon["log"]
        assert env["CUDA_VISIBLE_DEVICES"] == GPU0
    assert first["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "12"
    assert first["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10194M"  # 1/8 of 81559 MiB, by device index
    assert second["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert second["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20389M"

    (job_dir(agent, 9101) / "go").touch()
    wait_for(lambda: "job 9101 attempt 1 ended" in agent.log(), timeout=45, what="the first slice to end")
    assert [c["argv"] for c in mps_control()] == ["-d"]  # the GPU still holds a slice: the daemon stays
    (job_dir(agent, 9102) / "go").touch()
    wait_for(lambda: len(mps_control()) == 2, timeout=45, what="the daemon to be stopped")
    quit_call = mps_control()[1]
    assert quit_call["argv"] == "" and quit_call["stdin"] == "quit"
    assert quit_call["pipe"] == daemon["pipe"] and quit_call["gpu"] == GPU0


def test_a_slice_over_its_memory_total_is_stopped(nvml_agent, mps_control, fake_nvml):
    agent = nvml_agent()
    launch_direct(agent, 9103, [sys.executable, "-c", HOLD], gpu_uuids=[GPU1], share_milli=125, grace_s=1)
    pid = int(wait_output(agent, 9103, "PID=").split("PID=")[1].split()[0])
    # Two processes of the job would each stay under MPS's per-process cap; together they do not.
    fake_nvml.proc_add(1, pid, memory_mb=12_000, mps=True)
    wait_for(
        lambda: "stopping job 9103: GPU memory 12000 MiB exceeds the slice's 10194 MiB" in agent.log(),
        timeout=45,
        what="the agent to stop the slice",
    )
    wait_for(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        timeout=30,
        what="the job's process to end",
    )
    # The driver still lists the pid: the slice is not reported free yet.
    assert "job 9103 attempt 1 ended" not in agent.log()
    fake_nvml.procs.clear()
    fake_nvml.save()
    wait_for(lambda: "job 9103 attempt 1 ended" in agent.log(), timeout=45, what="the slice to be reported ended")
