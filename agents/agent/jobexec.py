"""The launch helper: a job's privilege drop as a small program of its own (``jobexec.c``).

A launch with the drop in Python (``sandbox.Drop`` as ``preexec_fn``) makes Python fork the whole agent
and run Python in the child: ~2 ms of the agent's time per launch, ~4 ms in a busy agent (docs/benchmarks.md,
session 24), which bounds how fast a node starts short jobs. Without a ``preexec_fn`` Python starts a
program with ``vfork`` (~0.4 ms), so the agent starts ``gpushare-jobexec`` instead, which takes the same
steps in C and then runs the job's program. ``make native`` (``scripts/jobexec_build.py``) builds it into
``build/agent/``; without it (no C compiler) the agent keeps the Python drop and says so at start.

The helper starts as the agent (root on a multi-tenant node), so it is trusted only where no one else could
have replaced it: a regular file owned by root or the agent's user, in a folder owned by one of them, neither
writable by group or others. It is started with an empty environment; the job's comes to it through a
memory file (never on a command line, which every local user can read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

NAME = "gpushare-jobexec"
BUILD = Path(__file__).resolve().parents[2] / "build" / "agent"
BUILT = BUILD / NAME
SOURCE = Path(__file__).with_name("jobexec.c")


class JobexecUntrusted(RuntimeError):
    pass


def untrusted_why(path: Path) -> str:
    """Why ``path`` may not be run as the launch helper ("" when it may)."""
    owners = {0, os.geteuid()}
    try:
        file, folder = os.stat(path), os.stat(path.parent)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(file.st_mode) or not os.access(path, os.X_OK):
        return f"{path} is not an executable file"
    for what, st in ((path, file), (path.parent, folder)):
        if st.st_uid not in owners:
            return f"{what} is owned by uid {st.st_uid}, neither root nor this agent's user"
        if st.st_mode & 0o022:
            return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def jobexec_find(setting: str) -> Path | None:
    """The helper to launch jobs through, from the ``--jobexec`` setting: ``auto`` (the build's, when it is
    there and trusted), ``off`` (None: the Python drop), or a path, which must be trusted (else raises)."""
    if setting == "off":
        return None
    if setting == "auto":
        return BUILT if BUILT.exists() and not untrusted_why(BUILT) else None
    path = Path(setting).resolve()
    problem = untrusted_why(path)
    if problem:
        raise JobexecUntrusted(f"--jobexec {setting}: {problem}")
    return path


def environment_file(env: dict[str, str]) -> int:
    """A memory file holding ``env`` as the helper reads it ("K=V" entries, each ended by a NUL byte); its
    descriptor, for ``pass_fds`` (the caller closes it once the helper has started)."""
    fd = os.memfd_create("gpushare-job-env", os.MFD_CLOEXEC)
    try:
        data = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def jobexec_argv(helper: Path, *, env_fd: int, drop, argv: list[str]) -> list[str]:
    """The helper's command line for ``argv`` run under ``drop`` (a ``sandbox.Drop``)."""
    return [
        str(helper),
        str(env_fd),
        drop.cgroup_procs,
        "-" if drop.uid is None else str(drop.uid),
        "-" if drop.uid is None else str(drop.gid),
        str(drop.nproc),
        str(drop.nofile),
        f"{drop.umask:o}",
        "--",
        *argv,
    ]
