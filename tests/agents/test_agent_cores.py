"""The agent's pure parts: metering windows, energy split, health classes,
slice caps, the job's environment and the docker command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.agent.health import event_describe, event_is_application_error, event_takes_gpu_out
from agents.agent.jobs import LaunchSpec, docker_argv, job_environment
from agents.agent.meter import JobMeter, split_energy
from agents.agent.mps import slice_client_env


def spec(**overrides) -> LaunchSpec:
    fields = dict(
        job_id=5,
        attempt=2,
        command=["python", "train.py"],
        env={},
        gpu_uuids=["GPU-a", "GPU-b"],
        share_milli=1000,
        mode="dedicated",
        max_runtime_s=60,
        grace_s=9,
        image="",
    )
    return LaunchSpec(**{**fields, **overrides})


def test_windows_tile_the_run_and_number_from_zero():
    meter = JobMeter(job_id=1, attempt=1, start_ms=1_000, window_ms=1_000)
    windows = []
    for at in range(1_250, 3_600, 250):
        if w := meter.add(at_ms=at, sm_util_pct=50, memory_mb=100, energy_mj=10):
            windows.append(w)
    windows.append(meter.close(3_700))
    assert [w.seq for w in windows] == [0, 1, 2]
    assert [(w.start_ms, w.end_ms) for w in windows] == [(1_000, 2_000), (2_000, 3_000), (3_000, 3_700)]
    assert windows[0].sm_util_ms == 500 and windows[0].memory_avg_mb == 100
    assert sum(w.energy_mj for w in windows) == 100  # ten samples of 10 mJ
    assert meter.close(3_700) is None  # nothing left to close


def test_energy_split_follows_weights_and_falls_back_to_equal_shares():
    assert split_energy(900, {1: 2.0, 2: 1.0}) == {1: 600, 2: 300}
    assert split_energy(900, {1: 0.0, 2: 0.0}) == {1: 450, 2: 450}
    assert split_energy(900, {}) == {}


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_fail_the_job_not_the_gpu(xid):
    event = {"kind": "xid", "xid": xid}
    assert event_is_application_error(event) and not event_takes_gpu_out(event)
    assert event_describe(event) == f"XID {xid} (application error)"


@pytest.mark.parametrize(
    "event",
    [
        {"kind": "xid", "xid": 79},
        {"kind": "xid", "xid": 48},
        {"kind": "ecc_double_bit"},
        {"kind": "row_remap_pending"},
        {"kind": "gpu_lost"},
    ],
)
def test_hardware_events_take_the_gpu_out(event):
    assert event_takes_gpu_out(event) and not event_is_application_error(event)


def test_a_corrected_ecc_error_keeps_the_gpu():
    assert not event_takes_gpu_out({"kind": "ecc_single_bit"})


@pytest.mark.parametrize(
    ("share", "pct", "limit"), [(125, "12", "0=10194M"), (250, "25", "0=20389M"), (500, "50", "0=40779M")]
)
def test_slice_caps(share, pct, limit):
    assert slice_client_env(share_milli=share, gpu_memory_mb=81559) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limit,
    }


def test_job_environment_is_allow_listed_and_pinning_wins(tmp_path):
    env = job_environment(
        spec(env={"CUDA_VISIBLE_DEVICES": "all", "Ld_Preload": "x", "gpushare_job_id": "1", "SEED": "7"}),
        workdir=tmp_path,
        agent_env={"PATH": "/bin", "REDIS_URL": "redis://secret", "GPUSHARE_AGENT_TOKEN": "t", "TZ": "UTC"},
        allow=("PATH", "TZ"),
        extra={"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"},
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b" and env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["SEED"] == "7" and env["TZ"] == "UTC" and env["PATH"] == "/bin"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert env["GPUSHARE_JOB_ID"] == "5" and env["GPUSHARE_GRACE_SECONDS"] == "9"
    for name in ("REDIS_URL", "GPUSHARE_AGENT_TOKEN", "Ld_Preload", "gpushare_job_id"):
        assert name not in env


def test_docker_argv_pins_by_uuid_and_keeps_values_off_argv():
    # The job's variables travel in a 0600 --env-file (tests/security/test_runtime_steering.py), never on argv.
    argv = docker_argv(
        spec(image="nvcr.io/nvidia/pytorch:24.05-py3"),
        docker="docker",
        env_file=Path("/var/lib/gpushare/agent/n/env/5-2.env"),
        workdir=Path("/var/lib/gpushare/jobs/5-2"),
        run_as=(1000, 1000),
        cgroup_parent="/system.slice/gpushare-agent.service/jobs/job-5-2",
    )
    assert argv[:2] == ["docker", "run"]
    # The container's cgroup goes below the job's (cgroupfs driver: a path from the cgroup v2 mount).
    assert argv[argv.index("--cgroup-parent") + 1] == "/system.slice/gpushare-agent.service/jobs/job-5-2"
    assert argv[argv.index("--gpus") + 1] == '"device=GPU-a,GPU-b"'
    assert argv[argv.index("--user") + 1] == "1000:1000"
    assert argv[argv.index("--name") + 1] == "gpushare-job-5-2"
    assert argv[argv.index("--env-file") + 1] == "/var/lib/gpushare/agent/n/env/5-2.env"
    assert argv[-4:] == ["--", "nvcr.io/nvidia/pytorch:24.05-py3", "python", "train.py"]
    no_gpu = docker_argv(spec(image="alpine", gpu_uuids=[]), docker="docker", workdir=Path("/w"))
    assert "--gpus" not in no_gpu and "--cgroup-parent" not in no_gpu
