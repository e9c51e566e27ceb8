"""scripts/gpu_smoke.py without a real GPU: it fails cleanly, with a clear report."""

from __future__ import annotations

import subprocess
import sys

from tests.processes import ROOT

SCRIPT = ROOT / "scripts" / "gpu_smoke.py"


def run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "2"],
        env={"PATH": "/usr/bin:/bin", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_nvml_it_says_so_and_exits_2():
    result = run({})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[FAIL] NVML is not available on this host" in result.stdout
    assert "run this on a GPU server" in result.stdout


def test_with_nvml_but_no_cuda_driver_it_reports_each_check(fake_nvml_dir, fake_nvml):
    result = run({"LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_CONFIG": str(fake_nvml.path)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[PASS] inventory: 2 GPU(s), driver 550.54.15, CUDA 12.4" in result.stdout
    assert "[FAIL] pinned process: could not load libcuda.so.1" in result.stdout
    assert "checks passed in" in result.stdout
