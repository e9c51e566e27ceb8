"""Smoke test of the agent's NVML path on a real NVIDIA GPU (about a minute; at most five).

    python scripts/gpu_smoke.py [--gpu UUID] [--skip-mps] [--seconds 12]

Checks, through the agent's own code (agents.agent.nvml / agents.agent.mps):

1. inventory: NVML lists the GPUs (uuid, model, memory, MIG mode), driver and CUDA versions;
2. pinning and per-process metering: a CUDA process started with
   CUDA_VISIBLE_DEVICES=<uuid> is seen by NVML on that GPU only, with its
   memory (it allocates 1 GiB) and SM utilisation (it runs a busy kernel);
3. energy: the GPU's energy counter grows while it works;
4. an MPS slice: one control daemon for the GPU, a client with a 1/4 slice's
   caps: its context is limited to about 25 % of the SMs, and an allocation
   above its pinned memory limit fails while a small one succeeds.

The CUDA work is done through the driver API (libcuda.so.1, ctypes) with a
PTX kernel: no PyTorch or CUDA toolkit needed. Prints a report and exits 0
when every check passed, 1 when one failed, 2 when NVML is not usable at all.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.agent.gpus import JobProcesses  # noqa: E402
from agents.agent.mps import CONTROL, MpsDaemons, slice_client_env  # noqa: E402
from agents.agent.nvml import NvmlBackend, NvmlUnavailable  # noqa: E402

PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry spin(.param .u64 n)
{
    .reg .u64 %rd<3>;
    .reg .pred %p;
    ld.param.u64 %rd1, [n];
    mov.u64 %rd2, 0;
LOOP:
    add.u64 %rd2, %rd2, 1;
    setp.lt.u64 %p, %rd2, %rd1;
    @%p bra LOOP;
    ret;
}
"""

CUDA_ERROR_OUT_OF_MEMORY = 2
SM_COUNT_ATTRIBUTE = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT


class CudaError(RuntimeError):
    pass


def _cuda():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaError(f"could not load libcuda.so.1 (the CUDA driver): {exc}") from exc

    def call(name, *args):
        code = getattr(cuda, name)(*args)
        if code != 0:
            raise CudaError(f"{name} failed with CUDA error {code}")

    return cuda, call


def worker(mode: str, seconds: float, alloc_mb: int, over_mb: int) -> None:
    """The CUDA process the checks watch (runs in a child process)."""
    cuda, call = _cuda()
    call("cuInit", 0)
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", ctypes.byref(device), 0)
    call("cuCtxCreate_v2", ctypes.byref(ctx), 0, device)
    report: dict = {"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    sms = ctypes.c_int()
    call("cuDeviceGetAttribute", ctypes.byref(sms), SM_COUNT_ATTRIBUTE, device)
    report["device_sms"] = sms.value
    affinity = (ctypes.c_uint * 2)()  # CUexecAffinityParam {type; param.smCount.val}
    if cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), 0) == 0:
        report["context_sms"] = affinity[1]
    buffer = ctypes.c_uint64()
    call("cuMemAlloc_v2", ctypes.byref(buffer), ctypes.c_size_t(alloc_mb << 20))
    report["allocated_mb"] = alloc_mb
    if over_mb:
        big = ctypes.c_uint64()
        code = cuda.cuMemAlloc_v2(ctypes.byref(big), ctypes.c_size_t(over_mb << 20))
        report["over_limit_alloc_error"] = code
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(PTX))
    call("cuModuleGetFunction", ctypes.byref(function), module, b"spin")
    print("READY " + json.dumps(report), flush=True)
    if mode == "busy":
        n = ctypes.c_uint64(20_000_000)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(n), ctypes.c_void_p))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            call("cuLaunchKernel", function, 1024, 1, 1, 256, 1, 1, 0, None, params, None)
            call("cuCtxSynchronize")
    else:
        time.sleep(seconds)


class Report:
    def __init__(self):
        self.rows: list[tuple[str, bool, str]] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.rows.append((name, ok, detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return ok

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.rows)


def start_worker(mode: str, env: dict, *, seconds: float, alloc_mb: int = 1024, over_mb: int = 0):
    argv = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--seconds",
        str(seconds),
        "--alloc-mb",
        str(alloc_mb),
        "--over-mb",
        str(over_mb),
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("READY "):
            return proc, json.loads(line[6:])
        if line.startswith("ERROR "):
            proc.wait(timeout=30)
            raise CudaError(line[6:].strip())
    proc.kill()
    raise CudaError("the CUDA worker did not start: " + "".join(lines).strip()[-800:])


def base_env(uuid: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_"))}
    env.update(CUDA_VISIBLE_DEVICES=uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return env


def check_pinned(report: Report, backend: NvmlBackend, uuid: str, seconds: float) -> None:
    try:
        proc, info = start_worker("busy", base_env(uuid), seconds=seconds)
    except CudaError as exc:
        report.check("pinned process", False, str(exc))
        return
    job = JobProcesses(job_id=1, gpu_uuids=(uuid,), pids=frozenset({info["pid"]}), share_milli=1000)
    first = backend.sample([job])[uuid]
    peak_mb, peak_sm, elsewhere = 0, 0.0, set()
    deadline = time.monotonic() + seconds - 1
    while time.monotonic() < deadline:
        time.sleep(1)
        samples = backend.sample([job])
        use = samples[uuid].jobs[1]
        peak_mb, peak_sm = max(peak_mb, use.memory_mb), max(peak_sm, use.sm_util)
        for other in backend.inventory():
            if other.uuid != uuid and info["pid"] in (backend.pids_on_gpu(other.uuid) or set()):
                elsewhere.add(other.uuid)
    last = backend.sample([job])[uuid]
    proc.wait(timeout=60)
    report.check(
        "pinning",
        info["visible"] == uuid and not elsewhere,
        f"worker saw CUDA_VISIBLE_DEVICES={info['visible']}; on other GPUs: {sorted(elsewhere) or 'none'}",
    )
    report.check("per-process memory", peak_mb >= 1000, f"NVML attributed {peak_mb} MiB to the worker (allocated 1024)")
    report.check(
        "per-process SM utilisation", peak_sm > 0, f"peak {peak_sm:.0f} % from nvmlDeviceGetProcessUtilization"
    )
    if first.energy_mj is None or last.energy_mj is None:
        report.check("energy", False, "nvmlDeviceGetTotalEnergyConsumption is not supported on this GPU")
    else:
        delta = last.energy_mj - first.energy_mj
        report.check("energy", delta > 0, f"{delta / 1000:.1f} J over the busy period")


def check_mps(report: Report, backend: NvmlBackend, uuid: str, memory_mb: int) -> None:
    binary = shutil.which(CONTROL)
    if binary is None:
        report.check("MPS slice", False, f"{CONTROL} is not on PATH (install the driver's MPS tools or --skip-mps)")
        return
    with tempfile.TemporaryDirectory(prefix="gpushare-smoke-mps-") as tmp:
        daemons = MpsDaemons(base_dir=Path(tmp), binary=binary)
        try:
            env = base_env(uuid)
            env.update(daemons.acquire(uuid=uuid, job_id=2))
            caps = slice_client_env(share_milli=250, gpu_memory_mb=memory_mb)
            env.update(caps)
            limit_mb = memory_mb * 250 // 1000
            proc, info = start_worker("idle", env, seconds=4, alloc_mb=256, over_mb=limit_mb + 1024)
            seen = info["pid"] in (backend.pids_on_gpu(uuid) or set())
            proc.wait(timeout=60)
        except (CudaError, RuntimeError) as exc:
            report.check("MPS slice", False, str(exc))
            return
        finally:
            daemons.close()
    context_sms, device_sms = info.get("context_sms"), info["device_sms"]
    report.check("MPS client seen by NVML", seen, f"pid {info['pid']} listed on {uuid}: {seen}")
    report.check(
        "MPS compute cap",
        context_sms is not None and context_sms <= device_sms * 0.3,
        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={caps['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}: "
        f"context has {context_sms} of {device_sms} SMs",
    )
    report.check(
        "MPS memory cap",
        info.get("over_limit_alloc_error") == CUDA_ERROR_OUT_OF_MEMORY,
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={caps['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT']}: 256 MiB allocated, "
        f"{limit_mb + 1024} MiB refused with error {info.get('over_limit_alloc_error')}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="GPU uuid to test (default: the first one)")
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the busy worker runs")
    parser.add_argument("--skip-mps", action="store_true")
    parser.add_argument("--worker", choices=["busy", "idle"], help=argparse.SUPPRESS)
    parser.add_argument("--alloc-mb", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--over-mb", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        try:
            worker(args.worker, args.seconds, args.alloc_mb, args.over_mb)
        except CudaError as exc:
            print(f"ERROR {exc}", flush=True)
            return 1
        return 0

    started = time.monotonic()
    report = Report()
    try:
        backend = NvmlBackend(state_dir=Path(tempfile.gettempdir()) / "gpushare-smoke")
    except NvmlUnavailable as exc:
        print(f"[FAIL] NVML is not available on this host: {exc}", flush=True)
        print("gpu_smoke: no NVIDIA driver/NVML here; run this on a GPU server.", flush=True)
        return 2
    try:
        gpus = backend.inventory()
        versions = backend.versions()
        report.check(
            "inventory",
            bool(gpus),
            f"{len(gpus)} GPU(s), driver {versions['driver_version'] or '?'}, CUDA {versions['cuda_version'] or '?'}",
        )
        for g in gpus:
            print(f"       {g.index}: {g.uuid} {g.model} {g.memory_mb} MiB mig={g.mig_mode} slices={g.isolation}")
        if gpus:
            target = next((g for g in gpus if g.uuid == args.gpu), None) if args.gpu else gpus[0]
            if target is None:
                report.check("gpu selection", False, f"no GPU {args.gpu} on this host")
            else:
                check_pinned(report, backend, target.uuid, args.seconds)
                if not args.skip_mps:
                    check_mps(report, backend, target.uuid, target.memory_mb)
    finally:
        backend.close()
    passed = sum(ok for _, ok, _ in report.rows)
    print(f"gpu_smoke: {passed}/{len(report.rows)} checks passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
