"""Build and drive the fake ``libnvidia-ml.so.1`` (``fake_nvml.c``).

``build(out_dir, omit=...)`` compiles it with gcc; :class:`FakeNvml` writes the
file it reads (re-read on every NVML call, so a test can change what the
"driver" reports while an agent runs).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY = "libnvidia-ml.so.1"

# Event types (nvml.h)
EVENT_XID = 0x8
EVENT_ECC_DOUBLE_BIT = 0x2


def build(out_dir: Path, *, omit: tuple[str, ...] = ()) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``; return ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = ["gcc", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", f"-Wl,-soname,{LIBRARY}"]
    argv += [f"-DOMIT_{name}" for name in omit]
    argv += ["-o", str(out_dir / LIBRARY), str(SOURCE)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"building the fake NVML failed: {result.stderr}")
    return out_dir


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mb: int = 81559
    util: int = 0
    mem_util: int = 0
    power_mw: int = 0
    energy_mj: int = 0
    temperature_c: int = 40
    mig: bool = False


@dataclass
class FakeNvml:
    """The fake driver's state; ``save()`` writes it where the library reads it."""

    path: Path
    gpus: list[FakeGpu] = field(default_factory=list)
    migs: list[tuple[int, str, int, int]] = field(default_factory=list)  # (gpu index, uuid, memory_mb, gi id)
    procs: list[tuple[int, int, int, int, int, str]] = field(default_factory=list)  # gpu, pid, MiB, sm, mem, kind
    events: list[tuple[int, int, int, int]] = field(default_factory=list)  # id, gpu, type, data
    fails: dict[str, int] = field(default_factory=dict)
    driver: str = "550.54.15"
    cuda: int = 12040

    def proc_add(self, gpu: int, pid: int, *, memory_mb: int, sm_util: int = 0, mem_util: int = 0, mps=False):
        self.procs.append((gpu, pid, memory_mb, sm_util, mem_util, "mps" if mps else "compute"))
        return self.save()

    def xid(self, gpu: int, xid: int) -> FakeNvml:
        self.events.append((len(self.events) + 1, gpu, EVENT_XID, xid))
        return self.save()

    def save(self) -> FakeNvml:
        lines = [f"driver {self.driver}", f"cuda {self.cuda}"]
        for g in self.gpus:
            lines.append(
                f"gpu {g.uuid} {g.memory_mb} {g.util} {g.mem_util} {g.power_mw} {g.energy_mj} {g.temperature_c} "
                f"{int(g.mig)} {g.name}"
            )
        lines += [f"mig {gpu} {uuid} {memory} {gi}" for gpu, uuid, memory, gi in self.migs]
        lines += [f"proc {g} {pid} {mib} {sm} {mem} {kind}" for g, pid, mib, sm, mem, kind in self.procs]
        lines += [f"event {i} {g} {t} {d}" for i, g, t, d in self.events]
        lines += [f"fail {name} {code}" for name, code in self.fails.items()]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)  # atomic: the library never reads half a file
        return self
