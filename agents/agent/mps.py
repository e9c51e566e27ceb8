"""One MPS control daemon per shared GPU (NVIDIA Multi-Process Service).

The daemon of a GPU starts with the first slice placed on it and stops (``quit``
on the control program's stdin) when its last slice ends. Each daemon has its
own pipe and log directories; a client finds its daemon through
``CUDA_MPS_PIPE_DIRECTORY`` and gets its caps through
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
The memory limit is set by device index (``0``: the job sees its one GPU as
device 0), since limits by UUID were reported not to apply. MPS limits are per
client process; the agent enforces the per-job total itself by watching NVML.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"


def mps_control_binary() -> str | None:
    return shutil.which(CONTROL)


def slice_client_env(*, share_milli: int, gpu_memory_mb: int) -> dict[str, str]:
    """The caps of a client holding ``share_milli``/1000 of a GPU (pure)."""
    percentage = max(1, share_milli * 100 // 1000)
    limit_mb = gpu_memory_mb * share_milli // 1000
    return {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit_mb}M",
    }


class MpsDaemons:
    def __init__(self, *, base_dir: Path, binary: str):
        self.base_dir = base_dir
        self.binary = binary
        self.holders: dict[str, set[int]] = {}  # GPU uuid -> job ids holding a slice

    def _dirs(self, uuid: str) -> tuple[Path, Path]:
        root = self.base_dir / uuid
        return root / "pipe", root / "log"

    def _env(self, uuid: str) -> dict[str, str]:
        pipe, logs = self._dirs(uuid)
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME")}
        env.update(CUDA_VISIBLE_DEVICES=uuid, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
        return env

    def acquire(self, *, uuid: str, job_id: int) -> dict[str, str]:
        """Make sure ``uuid``'s daemon runs; return what a client needs to find it."""
        pipe, logs = self._dirs(uuid)
        if not self.holders.get(uuid):
            pipe.mkdir(parents=True, exist_ok=True)
            logs.mkdir(parents=True, exist_ok=True)
            for path in (self.base_dir, pipe.parent, pipe, logs):  # job uids (the clients) must reach the pipe
                os.chmod(path, 0o755)
            result = subprocess.run(
                [self.binary, "-d"], env=self._env(uuid), capture_output=True, timeout=30, check=False
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"could not start the MPS daemon for {uuid}: exit {result.returncode} "
                    f"{result.stderr.decode(errors='replace').strip()}"
                )
            log.info("MPS control daemon started for %s", uuid)
        self.holders.setdefault(uuid, set()).add(job_id)
        return {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}

    def release(self, *, uuid: str, job_id: int) -> None:
        """Forget ``job_id``'s slice; stop the daemon when the GPU has none left."""
        holders = self.holders.get(uuid)
        if not holders or job_id not in holders:
            return
        holders.discard(job_id)
        if not holders:
            self._quit(uuid)
            del self.holders[uuid]

    def _quit(self, uuid: str) -> None:
        try:
            subprocess.run([self.binary], input=b"quit\n", env=self._env(uuid), timeout=30, check=False)
            log.info("MPS control daemon stopped for %s", uuid)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("could not stop the MPS daemon for %s: %s", uuid, exc)

    def close(self) -> None:
        for uuid in list(self.holders):
            self._quit(uuid)
        self.holders.clear()
