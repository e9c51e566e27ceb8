"""Optional cgroup v2 per job: every process of the job, including those that
left its process group (``setsid``, double fork), is found in ``cgroup.procs``
and killed at once through ``cgroup.kill`` (Linux 5.14+).

Enabled with ``--cgroup-root PATH`` (a writable cgroup v2 directory: under
systemd, the agent's own cgroup with ``Delegate=yes``) or ``--cgroup-root
auto`` (the agent's own cgroup on the unified hierarchy, when writable). A
process job joins its cgroup between fork and exec, in the agent's own code,
before it drops privileges (``sandbox.Drop``).

An image job's cgroup is the container's ``--cgroup-parent``: the engine (cgroupfs driver)
creates the container's own cgroup inside it, so the job's processes are the whole subtree
(``pids`` reads every descendant; ``cgroup.kill`` kills the subtree; ``remove`` takes the
child cgroups the engine leaves). A process the GPU driver reports is the job's when its
unified-hierarchy cgroup (``/proc/<pid>/cgroup``, the ``0::`` line) lies under the job's.
"""

from __future__ import annotations

import functools
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


def pid_cgroup(pid: int) -> str | None:
    """``pid``'s cgroup on the unified hierarchy (the ``0::`` line of ``/proc/<pid>/cgroup``), or None."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)


class JobCgroup:
    def __init__(self, path: Path):
        self.path = path

    @functools.cached_property
    def relative(self) -> str | None:
        """The cgroup as its processes' ``0::`` line and docker's ``--cgroup-parent`` name it:
        its path below the cgroup v2 mount (``/gpushare-jobs/job-7-1``), or None when it is not on it."""
        mount = unified_mount()
        if mount is None:
            return None
        try:
            return "/" + str(self.path.relative_to(mount))
        except ValueError:
            return None

    def holds(self, cgroup: str) -> bool:
        """Whether a process in ``cgroup`` (a ``pid_cgroup`` answer) is inside this cgroup's subtree."""
        own = self.relative
        return own is not None and (cgroup == own or cgroup.startswith(own + "/"))

    def _tree(self) -> list[Path]:
        """This cgroup and every cgroup below it, deepest first."""
        tree = [Path(top) for top, _dirs, _files in os.walk(self.path, topdown=False)]
        return tree or [self.path]

    @classmethod
    def create(cls, root: Path, name: str) -> JobCgroup:
        path = root / f"{PREFIX}{name}"
        path.mkdir(exist_ok=True)
        return cls(path)

    def pids(self) -> set[int]:
        """Every process in the subtree (a container's cgroup below the job's included)."""
        found: set[int] = set()
        for path in self._tree():
            found.update(_procs(path))
        return found

    def kill(self) -> None:
        """SIGKILL the whole subtree (``cgroup.kill`` reaches the descendants too)."""
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
        """Remove the cgroup and the child cgroups left in it (a container engine's), once empty."""
        for _ in range(20):
            if not self.path.exists():
                return
            try:
                for path in self._tree():
                    path.rmdir()
                return
            except FileNotFoundError:
                continue  # the engine removed its own child meanwhile: look again
            except OSError:
                time.sleep(0.05)
        log.warning("could not remove %s", self.path)


def _procs(path: Path) -> list[int]:
    """The pids in one cgroup's ``cgroup.procs`` (read every sample: plain ``os.read``, half the cost of ``open``)."""
    try:
        fd = os.open(path / "cgroup.procs", os.O_RDONLY)
    except OSError:
        return []
    try:
        data = b"".join(iter(lambda: os.read(fd, 65536), b""))
    except OSError:
        return []
    finally:
        os.close(fd)
    return [int(p) for p in data.split()]


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
