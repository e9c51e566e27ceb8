"""The NVML backend: real NVIDIA GPUs through ``pynvml`` (nvidia-ml-py).

Every NVML call that an older driver may lack goes through :meth:`_try`, so a
missing function makes that metric "unavailable" (None) instead of crashing.

Shared slices: a MIG-enabled GPU hands each slice its own MIG instance (the
smallest free one that holds the slice's memory); any other GPU runs one MPS
control daemon while it holds slices (see :mod:`agents.agent.mps`), or plain
time-slicing (isolation ``none``) when the host has no MPS.
"""

from __future__ import annotations

import glob
import logging
import re
import time
from pathlib import Path

from . import health
from .gpus import GpuInfo, GpuSample, JobProcesses, JobUse
from .mps import MpsDaemons, mps_control_binary, slice_client_env

log = logging.getLogger(__name__)

# A MIG instance fits a slice when it has at least this much of the slice's memory
# (profiles are 1/7 or 1/8 of the GPU: 1g.10gb holds a 1/8 slice of an 80 GB GPU).
MIG_FIT = 0.9


class NvmlUnavailable(RuntimeError):
    pass


class SliceUnavailable(RuntimeError):
    """No MIG instance fits the slice (the job fails with this reason)."""


def nvidia_devices_present() -> bool:
    """Whether the host has NVIDIA device nodes (then never simulate silently)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


# Marketed memory sizes (GB); NVML's total is a little less than the label.
MARKETED_GB = (8, 10, 12, 16, 20, 24, 32, 40, 48, 80, 94, 96, 141, 180, 192, 288)


def model_name(nvml_name: str, memory_mb: int) -> str:
    """The platform's model name (prices are keyed by it): "NVIDIA H100 80GB HBM3" -> "H100-80GB",
    "NVIDIA L4" with 23034 MiB -> "L4-24GB". Unrecognised names pass through without "NVIDIA "."""
    name = nvml_name.removeprefix("NVIDIA ").removeprefix("Tesla ").strip()
    family = re.match(r"([A-Z]+\d+[A-Z]*)\b", name)
    if not family:
        return name
    labelled = re.search(r"(\d+)\s?GB", name)
    if labelled:
        gb = int(labelled.group(1))
    else:
        gib = memory_mb / 1024
        gb = next((size for size in MARKETED_GB if size >= gib * 0.98), round(gib))
    return f"{family.group(1)}-{gb}GB"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    name = "nvml"
    enforces_memory = True

    def __init__(self, *, state_dir: Path | None = None, mps_binary: str | None = None):
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a requirement
            raise NvmlUnavailable(f"pynvml is not installed: {exc}") from exc
        self.nvml = pynvml
        self._errors = (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from exc
        binary = mps_binary or mps_control_binary()
        mps_dir = (state_dir or Path("/tmp/gpushare-agent")) / "mps"
        self.mps = MpsDaemons(base_dir=mps_dir, binary=binary) if binary else None
        self.handles = []
        self._gpus: list[GpuInfo] = []
        self.mig_instances: dict[str, list[dict]] = {}  # GPU uuid -> [{uuid, memory_mb, gpu_instance_id}]
        self.mig_holders: dict[str, int] = {}  # MIG uuid -> job id
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mig = self._try(pynvml.nvmlDeviceGetMigMode, handle)
            mig_enabled = bool(mig and mig[0])
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            memory_mb = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20))
            if mig_enabled:
                self.mig_instances[uuid] = self._mig_list(handle)
            info = GpuInfo(
                index=index,
                uuid=uuid,
                model=model_name(_text(pynvml.nvmlDeviceGetName(handle)), memory_mb),
                memory_mb=memory_mb,
                mig_mode=mig_enabled,
                isolation="mig" if mig_enabled else ("mps" if self.mps else "none"),
                mig_instances=tuple(self.mig_instances.get(uuid, ())),
            )
            self.handles.append(handle)
            self._gpus.append(info)
        self._last_seen: dict[int, int] = {}
        self._remap_pending: set[str] = set()
        self._events = self._events_register()

    def _try(self, fn, *args):
        """Call an NVML function; None when the driver or device does not support it."""
        try:
            return fn(*args)
        except self._errors as exc:
            log.debug("%s unavailable: %s", getattr(fn, "__name__", fn), exc)
            return None

    def _mig_list(self, handle) -> list[dict]:
        nvml = self.nvml
        found = []
        for i in range(self._try(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
            mig = self._try(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
            if mig is None:
                continue
            memory = self._try(nvml.nvmlDeviceGetMemoryInfo, mig)
            found.append(
                {
                    "uuid": _text(nvml.nvmlDeviceGetUUID(mig)),
                    "memory_mb": int(memory.total // (1 << 20)) if memory is not None else 0,
                    "gpu_instance_id": self._try(nvml.nvmlDeviceGetGpuInstanceId, mig),
                }
            )
        return found

    def _events_register(self):
        """An NVML event set for XID and ECC events; None when the driver lacks events."""
        nvml = self.nvml
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        event_set = self._try(nvml.nvmlEventSetCreate)
        if event_set is None:
            log.info("NVML health events unavailable on this driver; XID/ECC events will not be seen")
            return None
        registered = 0
        for info, handle in zip(self._gpus, self.handles, strict=True):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
                registered += 1
            except self._errors as exc:
                log.info("no XID/ECC events for %s: %s", info.uuid, exc)
        return event_set if registered else None

    def _events_poll(self) -> dict[str, list[dict]]:
        """Health events since the previous poll, by GPU uuid (never blocks)."""
        nvml = self.nvml
        out: dict[str, list[dict]] = {}
        if self._events is None:
            return out
        for _ in range(64):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                break
            except self._errors as exc:
                log.error("NVML event wait failed: %s; every GPU is reported lost", exc)
                for info in self._gpus:
                    out.setdefault(info.uuid, []).append({"kind": health.GPU_LOST, "detail": str(exc)})
                break
            uuid = _text(self._try(nvml.nvmlDeviceGetUUID, data.device) or "")
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                event = {"kind": health.XID, "xid": int(data.eventData)}
            elif data.eventType & nvml.nvmlEventTypeDoubleBitEccError:
                event = {"kind": health.ECC_DOUBLE_BIT}
            else:
                event = {"kind": f"event_{int(data.eventType):#x}"}
            out.setdefault(uuid, []).append(event)
        return out

    def inventory(self) -> list[GpuInfo]:
        return list(self._gpus)

    def versions(self) -> dict:
        driver = self._try(self.nvml.nvmlSystemGetDriverVersion)
        cuda = self._try(self.nvml.nvmlSystemGetCudaDriverVersion)
        return {
            "driver_version": _text(driver) if driver is not None else "",
            "cuda_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else "",
        }

    # --- slices ---------------------------------------------------------------

    def job_env(self, spec) -> dict[str, str]:
        """Extra environment for a job: its MIG instance or its MPS caps."""
        if spec.share_milli >= 1000 or len(spec.gpu_uuids) != 1:
            return {}
        info = next((g for g in self._gpus if g.uuid == spec.gpu_uuids[0]), None)
        if info is None:
            return {}
        if info.mig_mode:
            instance = self._mig_pick(info, spec)
            self.mig_holders[instance["uuid"]] = spec.job_id
            return {"CUDA_VISIBLE_DEVICES": instance["uuid"], "NVIDIA_VISIBLE_DEVICES": instance["uuid"]}
        if self.mps is None:
            return {}
        env = self.mps.acquire(uuid=info.uuid, job_id=spec.job_id)
        env.update(slice_client_env(share_milli=spec.share_milli, gpu_memory_mb=info.memory_mb))
        return env

    def _mig_pick(self, info: GpuInfo, spec) -> dict:
        need = info.memory_mb * spec.share_milli / 1000 * MIG_FIT
        free = [i for i in self.mig_instances.get(info.uuid, []) if i["uuid"] not in self.mig_holders]
        fitting = sorted((i for i in free if i["memory_mb"] >= need), key=lambda i: i["memory_mb"])
        if not fitting:
            raise SliceUnavailable(
                f"no free MIG instance on {info.uuid} holds a {spec.share_milli / 1000:g} slice "
                f"({int(need)} MiB); {len(free)} free instance(s)"
            )
        return fitting[0]

    def job_ended(self, spec) -> None:
        for mig_uuid, job_id in list(self.mig_holders.items()):
            if job_id == spec.job_id:
                del self.mig_holders[mig_uuid]
        if self.mps is not None:
            for uuid in spec.gpu_uuids:
                self.mps.release(uuid=uuid, job_id=spec.job_id)

    # --- metering ---------------------------------------------------------------

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
        """pid -> SM utilisation (%) since the previous call (absent: idle, 0)."""
        last = self._last_seen.get(index, 0)
        samples = self._try(self.nvml.nvmlDeviceGetProcessUtilization, handle, last) or []
        util: dict[int, int] = {}
        for s in samples:
            util[s.pid] = max(util.get(s.pid, 0), int(s.smUtil))
            last = max(last, int(s.timeStamp))
        self._last_seen[index] = last or int(time.time() * 1e6)
        return util

    def _row_remap_event(self, info: GpuInfo, handle) -> dict | None:
        remap = self._try(self.nvml.nvmlDeviceGetRemappedRows, handle)
        if remap is None:
            return None
        pending = bool(remap[2]) or bool(remap[3])
        if pending and info.uuid not in self._remap_pending:
            self._remap_pending.add(info.uuid)
            return {"kind": health.ROW_REMAP, "uncorrectable_rows": int(remap[1])}
        if not pending:
            self._remap_pending.discard(info.uuid)
        return None

    def sample(self, jobs: list[JobProcesses]) -> dict[str, GpuSample]:
        nvml = self.nvml
        out: dict[str, GpuSample] = {}
        events = self._events_poll()
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
                health_events=list(events.get(info.uuid, [])),
            )
            if remap := self._row_remap_event(info, handle):
                sample.health_events.append(remap)
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
        if self.mps is not None:
            self.mps.close()
        if self._events is not None:
            self._try(self.nvml.nvmlEventSetFree, self._events)
        self._try(self.nvml.nvmlShutdown)
