"""Optional cgroup v2 per job: every process of the job, including those that
left its process group (``setsid``, double fork), is found in ``cgroup.procs``
and killed at once through ``cgroup.kill`` (Linux 5.14+).

Enabled with ``--cgroup-root PATH`` (a writable cgroup v2 directory: under
systemd, the agent's own cgroup with ``Delegate=yes``) or ``--cgroup-root
auto`` (the agent's own cgroup on the unified hierarchy, when writable). The
job is placed in its cgroup by a tiny shell shim *before* it runs anything:
``echo $$ > cgroup.procs && exec [setpriv --reuid U --regid G --clear-groups --] cmd``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "job-"


def unified_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` or, on hybrid hosts, ``.../unified``)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def cgroup_root(setting: str) -> Path | None:
    """The directory job cgroups are created in, or None (process groups only)."""
    if not setting or setting == "off":
        return None
    if setting == "auto":
        mount = unified_mount()
        if mount is None:
            return None
        own = next(
            (line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")), "/"
        )
        root = mount / own.lstrip("/") / "gpushare-jobs"
    else:
        root = Path(setting)
    try:
        root.mkdir(exist_ok=True)
    except OSError as exc:
        log.warning("cgroup root %s is not usable (%s): jobs are tracked by process group only", root, exc)
        return None
    if not (root / "cgroup.procs").exists():
        log.warning("%s is not a cgroup v2 directory: jobs are tracked by process group only", root)
        return None
    return root


class JobCgroup:
    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, root: Path, name: str) -> JobCgroup:
        path = root / f"{PREFIX}{name}"
        path.mkdir(exist_ok=True)
        return cls(path)

    def shim(self, argv: list[str], *, run_as: tuple[int, int] | None = None) -> list[str]:
        """``argv`` wrapped so the process joins this cgroup before it runs (then drops to ``run_as``)."""
        drop = ["setpriv", f"--reuid={run_as[0]}", f"--regid={run_as[1]}", "--clear-groups", "--"] if run_as else []
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *drop, *argv]

    def pids(self) -> set[int]:
        try:
            return {int(p) for p in (self.path / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def kill(self) -> None:
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError as exc:  # no cgroup.kill (kernel < 5.14): signal what is listed
            log.debug("cgroup.kill on %s: %s", self.path, exc)
            for pid in self.pids():
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self) -> None:
        for _ in range(20):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        log.warning("could not remove %s", self.path)


def leftovers_kill(root: Path) -> list[str]:
    """Kill and remove job cgroups a previous run of the agent left behind."""
    killed = []
    for path in sorted(root.glob(f"{PREFIX}*")):
        cgroup = JobCgroup(path)
        if cgroup.pids():
            cgroup.kill()
            killed.append(path.name)
        cgroup.remove()
    return killed
