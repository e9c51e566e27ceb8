"""The NVML backend through the real pynvml code path, on the fake libnvidia-ml.so.1."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agents.agent.gpus import JobProcesses
from agents.agent.jobs import LaunchSpec
from agents.agent.nvml import NvmlBackend, SliceUnavailable, model_name
from tests.agents.conftest import GPU0, GPU1
from tests.fake_nvml import build
from tests.processes import ROOT


@pytest.fixture
def backend(load_fake_nvml, fake_nvml_dir, tmp_path):
    load_fake_nvml(fake_nvml_dir)
    made = []

    def make(**kwargs):
        b = NvmlBackend(state_dir=tmp_path / "state", **kwargs)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def spec(job_id=1, *, uuids=(GPU0,), share_milli=1000) -> LaunchSpec:
    return LaunchSpec(
        job_id=job_id,
        attempt=1,
        command=["true"],
        env={},
        gpu_uuids=list(uuids),
        share_milli=share_milli,
        mode="shared" if share_milli < 1000 else "dedicated",
        max_runtime_s=60,
        grace_s=5,
    )


def test_inventory_and_versions(backend):
    b = backend()
    gpus = b.inventory()
    assert [(g.index, g.uuid, g.model, g.memory_mb, g.mig_mode) for g in gpus] == [
        (0, GPU0, "H100-80GB", 81559, False),
        (1, GPU1, "H100-80GB", 81559, False),
    ]
    assert b.versions() == {"driver_version": "550.54.15", "cuda_version": "12.4"}


@pytest.mark.parametrize(
    ("name", "memory_mb", "model"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA L4", 23034, "L4-24GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "GeForce RTX 4090"),
        ("NVIDIA H200", 143771, "H200-141GB"),
    ],
)
def test_nvml_names_become_the_platforms_model_names(name, memory_mb, model):
    assert model_name(name, memory_mb) == model


def test_job_memory_and_utilisation_come_from_its_own_processes(backend, fake_nvml):
    b = backend()
    fake_nvml.proc_add(0, 4001, memory_mb=2048, sm_util=60)
    fake_nvml.proc_add(0, 4002, memory_mb=1024, sm_util=15)
    fake_nvml.proc_add(0, 5001, memory_mb=7000, sm_util=20)  # another job's process
    fake_nvml.proc_add(1, 4003, memory_mb=512, sm_util=0, mps=True)
    jobs = [
        JobProcesses(job_id=1, gpu_uuids=(GPU0, GPU1), pids=frozenset({4001, 4002, 4003}), share_milli=1000),
        JobProcesses(job_id=2, gpu_uuids=(GPU0,), pids=frozenset({5001}), share_milli=1000),
    ]
    samples = b.sample(jobs)
    assert samples[GPU0].jobs[1].memory_mb == 3072
    assert samples[GPU0].jobs[1].sm_util == 75
    assert samples[GPU0].jobs[2].memory_mb == 7000
    assert samples[GPU0].jobs[2].sm_util == 20
    assert samples[GPU1].jobs[1].memory_mb == 512  # an MPS client counts too
    assert samples[GPU1].jobs[1].sm_util == 0  # idle in the period: absent from the samples, so 0
    assert samples[GPU0].memory_used_mb == 10072
    assert samples[GPU0].util == 40
    assert samples[GPU0].power_w == 300
    assert b.pids_on_gpu(GPU0) == {4001, 4002, 5001}
    assert b.pids_on_gpu("GPU-unknown") is None


def test_energy_is_cumulative_so_deltas_follow_power(backend):
    b = backend()
    first = b.sample([])[GPU0].energy_mj
    time.sleep(0.5)
    second = b.sample([])[GPU0].energy_mj
    assert first >= 5_000_000
    # 300 W for ~0.5 s: ~150 J = 150,000 mJ (generous bounds: the machine is loaded).
    assert 100_000 <= second - first <= 600_000


def test_a_missing_function_makes_its_metric_unavailable(load_fake_nvml, tmp_path):
    old_driver = build(
        tmp_path / "old-driver",
        omit=(
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetProcessUtilization",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlEventSetCreate",
        ),
    )
    load_fake_nvml(old_driver)
    b = NvmlBackend(state_dir=tmp_path / "state")
    try:
        sample = b.sample([JobProcesses(job_id=1, gpu_uuids=(GPU0,), pids=frozenset({1}), share_milli=1000)])[GPU0]
        assert sample.energy_mj is None
        assert sample.power_w == 300  # what the driver has still works
        assert sample.jobs[1].memory_mb == 0 and sample.jobs[1].sm_util == 0
        assert b.pids_on_gpu(GPU0) == set()
        assert sample.health_events == []
    finally:
        b.close()


def test_agent_without_nvml_refuses_to_start_with_a_clear_message(tmp_path):
    """A host without the driver library: --gpus nvml fails; auto never simulates silently."""

    def run(*flags):
        return subprocess.run(
            [sys.executable, "-m", "agents", "--node", "n", "--token", "t", "--var-dir", str(tmp_path), *flags],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    explicit = run("--gpus", "nvml")
    assert explicit.returncode != 0
    assert "--gpus nvml but NVML is not usable" in explicit.stderr
    auto = run("--gpus", "auto")
    assert auto.returncode != 0
    assert "no NVML on this host" in auto.stderr and "--gpus sim:" in auto.stderr


def test_xid_and_ecc_events_are_reported_once(backend, fake_nvml):
    b = backend()
    fake_nvml.xid(0, 13)
    fake_nvml.xid(1, 79)
    samples = b.sample([])
    assert samples[GPU0].health_events == [{"kind": "xid", "xid": 13}]
    assert samples[GPU1].health_events == [{"kind": "xid", "xid": 79}]
    assert b.sample([])[GPU0].health_events == []


def test_event_wait_failure_reports_every_gpu_lost(backend, fake_nvml):
    b = backend()
    fake_nvml.fails["nvmlEventSetWait"] = 15  # NVML_ERROR_GPU_IS_LOST
    fake_nvml.save()
    samples = b.sample([])
    assert [e["kind"] for e in samples[GPU0].health_events] == ["gpu_lost"]
    assert [e["kind"] for e in samples[GPU1].health_events] == ["gpu_lost"]


def test_mig_gpu_reports_instances_and_places_a_slice_on_one(backend, fake_nvml):
    fake_nvml.gpus[1].mig = True
    fake_nvml.migs = [(1, "MIG-aaaa", 9856, 7), (1, "MIG-bbbb", 19968, 3), (1, "MIG-cccc", 9856, 8)]
    fake_nvml.save()
    b = backend(mps_binary=None)
    gpu = b.inventory()[1]
    assert gpu.mig_mode and gpu.isolation == "mig"
    assert [i["uuid"] for i in gpu.mig_instances] == ["MIG-aaaa", "MIG-bbbb", "MIG-cccc"]
    assert gpu.as_dict()["mig_instances"][1] == {"uuid": "MIG-bbbb", "memory_mb": 19968, "gpu_instance_id": 3}
    # A 1/8 slice (~10 GB) takes the smallest instance that holds it; a 1/4 the 20 GB one.
    assert b.job_env(spec(1, uuids=(GPU1,), share_milli=125))["CUDA_VISIBLE_DEVICES"] == "MIG-aaaa"
    assert b.job_env(spec(2, uuids=(GPU1,), share_milli=250))["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb"
    with pytest.raises(SliceUnavailable, match="no free MIG instance"):
        b.job_env(spec(3, uuids=(GPU1,), share_milli=500))
    b.job_ended(spec(1, uuids=(GPU1,), share_milli=125))
    assert b.job_env(spec(4, uuids=(GPU1,), share_milli=125))["NVIDIA_VISIBLE_DEVICES"] == "MIG-aaaa"


def test_real_loader_finds_the_fake_through_ld_library_path(fake_nvml_dir, fake_nvml):
    """The way an agent process loads it: pynvml's own dlopen("libnvidia-ml.so.1")."""
    code = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_CONFIG": str(fake_nvml.path), "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["2", "550.54.15"]
