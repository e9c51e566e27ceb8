"""The NVML backend: real NVIDIA GPUs through ``pynvml`` (nvidia-ml-py).

Every NVML call that an older driver may lack goes through :func:`_try`, so a
missing function makes that metric "unavailable" (None) instead of crashing.
"""

from __future__ import annotations

import glob
import logging
import time

from .gpus import GpuInfo, GpuSample, JobProcesses, JobUse

log = logging.getLogger(__name__)


class NvmlUnavailable(RuntimeError):
    pass


def nvidia_devices_present() -> bool:
    """Whether the host has NVIDIA device nodes (then never simulate silently)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    name = "nvml"
    enforces_memory = True

    def __init__(self):
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a requirement
            raise NvmlUnavailable(f"pynvml is not installed: {exc}") from exc
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from exc
        self.handles = []
        self._gpus: list[GpuInfo] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mig = self._try(pynvml.nvmlDeviceGetMigMode, handle)
            mig_enabled = bool(mig and mig[0])
            info = GpuInfo(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                model=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20)),
                mig_mode=mig_enabled,
                isolation="mig" if mig_enabled else "mps",
            )
            self.handles.append(handle)
            self._gpus.append(info)
        self._last_seen: dict[int, int] = {}

    def _try(self, fn, *args):
        """Call an NVML function; None when the driver or device does not support it."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            log.debug("%s unavailable: %s", getattr(fn, "__name__", fn), exc)
            return None

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def versions(self) -> dict:
        driver = self._try(self.nvml.nvmlSystemGetDriverVersion)
        cuda = self._try(self.nvml.nvmlSystemGetCudaDriverVersion)
        return {
            "driver_version": _text(driver) if driver is not None else "",
            "cuda_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else "",
        }

    def _processes(self, handle) -> dict[int, int]:
        """pid -> used GPU memory (MiB) for compute and MPS processes."""
        found: dict[int, int] = {}
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            fn = getattr(self.nvml, fn_name, None)
            for proc in (self._try(fn, handle) or []) if fn else []:
                used = proc.usedGpuMemory
                found[proc.pid] = found.get(proc.pid, 0) + (int(used) // (1 << 20) if used else 0)
        return found

    def _utilisation(self, index: int, handle) -> dict[int, int]:
        """pid -> SM utilisation (%) since the previous call."""
        last = self._last_seen.get(index, 0)
        samples = self._try(self.nvml.nvmlDeviceGetProcessUtilization, handle, last) or []
        util: dict[int, int] = {}
        for s in samples:
            util[s.pid] = max(util.get(s.pid, 0), int(s.smUtil))
            last = max(last, int(s.timeStamp))
        self._last_seen[index] = last or int(time.time() * 1e6)
        return util

    def sample(self, jobs: list[JobProcesses]) -> dict[str, GpuSample]:
        nvml = self.nvml
        out: dict[str, GpuSample] = {}
        for info, handle in zip(self._gpus, self.handles, strict=True):
            util = self._try(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._try(nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._try(nvml.nvmlDeviceGetPowerUsage, handle)
            energy = self._try(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            temperature = self._try(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            sample = GpuSample(
                uuid=info.uuid,
                util=float(util.gpu) if util is not None else None,
                memory_used_mb=int(memory.used // (1 << 20)) if memory is not None else None,
                power_w=power / 1000 if power is not None else None,
                energy_mj=int(energy) if energy is not None else None,
                temperature_c=int(temperature) if temperature is not None else None,
            )
            procs = self._processes(handle)
            per_pid_util = self._utilisation(info.index, handle)
            for job in jobs:
                if info.uuid not in job.gpu_uuids:
                    continue
                mine = job.pids & set(procs)
                sample.jobs[job.job_id] = JobUse(
                    sm_util=float(sum(per_pid_util.get(pid, 0) for pid in job.pids)),
                    memory_mb=sum(procs[pid] for pid in mine),
                )
            out[info.uuid] = sample
        return out

    def pids_on_gpu(self, uuid: str) -> set[int] | None:
        for info, handle in zip(self._gpus, self.handles, strict=True):
            if info.uuid == uuid:
                return set(self._processes(handle))
        return None

    def close(self) -> None:
        self._try(self.nvml.nvmlShutdown)
