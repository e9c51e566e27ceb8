"""Tools the benchmarks install for themselves from Debian (apt-get, as root), as make bench does
for Slurm: nothing is installed by hand on a fresh machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path


class ToolError(RuntimeError):
    pass


def apt_install(packages: tuple[str, ...], *, binaries: tuple[str, ...]) -> None:
    """Install ``packages`` unless every one of ``binaries`` is on PATH (root only).

    Debian's maintainer scripts may start system daemons; a policy-rc.d that denies
    them is put in place for the install when none exists.
    """
    if all(shutil.which(b) for b in binaries):
        return
    if os.geteuid() != 0:
        raise ToolError(f"{', '.join(packages)} missing; run as root or apt-get install {' '.join(packages)}")
    policy = Path("/usr/sbin/policy-rc.d")
    created = not policy.exists()
    if created:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        result = None
        for attempt in range(30):  # another apt may hold the lock for a while
            result = subprocess.run(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
                env=env,
                capture_output=True,
                text=True,
            )
            if result.returncode == 0:
                return
            if "lock" not in result.stderr or attempt == 0:
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            time.sleep(5)
        raise ToolError(f"apt-get install {' '.join(packages)} failed: {result.stderr[-2000:]}")
    finally:
        if created:
            policy.unlink(missing_ok=True)
