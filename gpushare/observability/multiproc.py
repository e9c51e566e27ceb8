"""Directories for prometheus-client's multiprocess mode (no prometheus import here).

``metrics_dir_create("gpushare-metrics-")`` makes ``$TMPDIR/gpushare-metrics-<pid>-XXXX`` for
the process that will fork the ones writing into it (a Celery worker, the web server's main process), and
removes the directories of earlier processes that are gone: a process killed with SIGKILL
never runs its exit hooks, and its files would otherwise stay behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def metrics_dir_create(prefix: str) -> str:
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{prefix}*"):
        owner = stale.name[len(prefix) :].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not _alive(int(owner)):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
