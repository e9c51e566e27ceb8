"""Tenant isolation on the node: a uid per job attempt, the privilege drop done
in the agent's own code, private dirs, and the agent's secrets kept off the
node's readable surface.

Multi-tenant mode (the agent runs as root, the default there): every job
attempt runs as its own unprivileged uid from the pool (``--uid-pool``,
default 200000-265535), with gid = uid and no supplementary group. The child
is forked by ``subprocess`` and, before it runs anything of the job's, the
agent's own ``preexec`` (no shell, no ``setpriv`` found through anyone's
``PATH``) joins the job's cgroup, sets the rlimits, drops to the job's uid and
sets ``no_new_privs``; only then does ``execve`` apply the job's environment.

Single-tenant mode (the agent is not root, or ``--tenancy single``): jobs run
as the agent's user (or ``--run-as``); the agent says so at start and at
registration (the console's fleet view shows it).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import pwd
import resource
import shutil
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpushare.agent")

DEFAULT_UID_POOL = (200000, 265535)
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


class IsolationError(RuntimeError):
    """The node cannot isolate tenants as configured: the agent refuses to start."""


def uid_pool_parse(text: str) -> tuple[int, int]:
    """``"200000-265535"`` -> (200000, 265535); raises ValueError with the reason."""
    first, sep, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError(f"uid pool {text!r} is not FIRST-LAST (e.g. 200000-265535)") from None
    if not 1000 <= low <= high < 2**31 - 1:
        raise ValueError(f"uid pool {text!r} must be within 1000-2147483646, first <= last")
    return low, high


# --- the privilege drop, in the child between fork and exec -----------------


@dataclass(frozen=True)
class Drop:
    """What the child does before ``execve``: all of it in this process's own code."""

    uid: int | None = None  # None: keep the agent's uid (single-tenant without --run-as)
    gid: int | None = None
    cgroup_procs: str = ""  # the job's cgroup.procs: joined first, while still privileged
    nproc: int = 0  # RLIMIT_NPROC (per uid: per job when the uid is the job's own); 0: unchanged
    nofile: int = 65536
    umask: int = 0o077

    def __call__(self) -> None:  # runs in the forked child: no logging, no imports, no locks
        if self.cgroup_procs:
            fd = os.open(self.cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
        _limit(resource.RLIMIT_CORE, 0)
        if self.nofile:
            _limit(resource.RLIMIT_NOFILE, self.nofile)
        if self.nproc:
            _limit(resource.RLIMIT_NPROC, self.nproc)
        os.umask(self.umask)
        if self.uid is not None:
            os.setgroups([])
            os.setresgid(self.gid, self.gid, self.gid)
            os.setresuid(self.uid, self.uid, self.uid)
            if os.getuid() != self.uid or os.geteuid() != self.uid or os.getgroups():
                os._exit(126)  # never run the job with privileges left
        if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            os._exit(126)


def _limit(which: int, value: int) -> None:
    """Soft and hard limit to ``value``, never above the agent's own hard limit (raising it needs privileges)."""
    _soft, hard = resource.getrlimit(which)
    cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (cap, cap))


# --- the uid pool -------------------------------------------------------------


def uids_running() -> dict[int, list[int]]:
    """Real uid -> pids of every process on the host (``/proc``)."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            uid = os.stat(entry.path).st_uid
        except OSError:
            continue
        out.setdefault(uid, []).append(int(entry.name))
    return out


def uid_kill_all(uid: int) -> None:
    """SIGKILL every process of ``uid`` at once: ``kill(-1)`` from a child that became ``uid``.

    Atomic against forks (the kernel walks the task list once), so a job's
    escaped, re-parented or double-forked processes end with it.
    """
    if os.geteuid() != 0:
        return
    for _ in range(5):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        os.waitpid(pid, 0)
        if uid not in uids_running():
            return
        time.sleep(0.05)


class UidPool:
    """Hands out uids for job attempts: never one a live job (of this agent or
    another on the host) holds, nor one any process still runs as.

    A uid is held with an ``flock`` on ``<lock_dir>/<uid>``: the kernel drops it
    when the agent dies, and the agent's next run kills what is left running as
    that uid (orphans) before the uid can be handed out again.
    """

    def __init__(self, first: int, last: int, lock_dir: Path):
        self.first, self.last = first, last
        self.lock_dir = lock_dir
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(lock_dir, 0o700)
        self.held: dict[int, int] = {}  # uid -> lock fd
        self.next = first

    def __contains__(self, uid: int) -> bool:
        return self.first <= uid <= self.last

    def users_inside(self) -> list[str]:
        """Accounts of the host whose uid is in the pool (such a uid owns things outside any job)."""
        return [f"{p.pw_name} ({p.pw_uid})" for p in pwd.getpwall() if p.pw_uid in self]

    def _lock(self, uid: int) -> int | None:
        fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def orphans_kill(self) -> dict[int, int]:
        """Kill the processes left running as pool uids no live agent holds: uid -> how many."""
        killed = {}
        for uid, pids in uids_running().items():
            if uid not in self or uid in self.held:
                continue
            fd = self._lock(uid)
            if fd is None:
                continue  # another live agent's job
            try:
                uid_kill_all(uid)
                killed[uid] = len(pids)
            finally:
                os.close(fd)
        return killed

    def acquire(self) -> int:
        running = uids_running()
        size = self.last - self.first + 1
        for step in range(size):
            uid = self.first + (self.next - self.first + step) % size
            if uid in self.held or uid in running:
                continue
            fd = self._lock(uid)
            if fd is None:
                continue
            if uid in uids_running():  # started between the scan and the lock
                os.close(fd)
                continue
            self.held[uid] = fd
            self.next = uid + 1 if uid < self.last else self.first
            return uid
        raise IsolationError(f"uid pool {self.first}-{self.last} exhausted: every uid is in use")

    def release(self, uid: int) -> None:
        """The job's attempt is over and its files removed: kill any straggler, free the uid."""
        uid_kill_all(uid)
        tmp_sweep(uid)
        fd = self.held.pop(uid, None)
        if fd is not None:
            os.close(fd)


def tmp_sweep(uid: int, roots: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")) -> None:
    """Remove what ``uid`` left in the host's shared temp dirs (the next holder of the uid must not find it)."""
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


# --- private dirs ---------------------------------------------------------------


def private_dir(path: Path, *, mode: int = 0o700) -> Path:
    """Create ``path`` (and parents) and make it ``mode``, owned by the agent."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path


def searchable_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0711 (every uid may pass through, none may list)."""
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for created in missing:
        os.chmod(created, 0o711)
    return path


def private_files(path: Path) -> None:
    """Every file directly in ``path`` made 0600 (an older agent left them 0644)."""
    for entry in path.iterdir():
        if entry.is_file() and not entry.is_symlink():
            os.chmod(entry, 0o600)


def traversable_by_others(path: Path) -> Path | None:
    """The first ancestor of ``path`` a job uid cannot enter (no o+x), or None."""
    for part in [path, *path.parents]:
        try:
            mode = os.stat(part).st_mode
        except FileNotFoundError:
            continue
        if not mode & stat.S_IXOTH:
            return part
    return None


def workdir_make(path: Path, *, owner: tuple[int, int] | None) -> Path:
    """A fresh 0700 work dir (with tmp/) owned by the job's uid; whatever was there is removed first."""
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    (path / "tmp").mkdir(mode=0o700)
    os.chmod(path, 0o700)
    os.chmod(path / "tmp", 0o700)
    if owner is not None:
        os.chown(path, *owner)
        os.chown(path / "tmp", *owner)
    return path


def disk_usage_bytes(path: Path, *, stop_at: int = 0) -> int:
    """Bytes allocated under ``path`` (never following symlinks); stops counting past ``stop_at``."""
    total = 0
    stack = [str(path)]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            if stop_at and total > stop_at:
                return total
    return total


# --- the agent's own secrets ----------------------------------------------------------


def secret_from_env(name: str) -> str:
    """Take ``name`` out of the environment: gone from ``os.environ`` (so no child inherits it) and
    its value overwritten in the process's initial environment block (``/proc/<pid>/environ``)."""
    value = os.environ.pop(name, "")
    if value:
        environ_scrub(name)
    return value


def environ_scrub(name: str) -> bool:
    """Overwrite ``NAME=value`` in this process's initial environment block with ``NAME=`` + NULs."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of stat(5)
        block = Path("/proc/self/environ").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    key = name.encode() + b"="
    offset = 0
    scrubbed = False
    for entry in block.split(b"\0"):
        if entry.startswith(key) and end - start >= offset + len(entry):
            value_at = start + offset + len(key)
            ctypes.memset(value_at, 0, len(entry) - len(key))
            scrubbed = True
        offset += len(entry) + 1
    return scrubbed
