"""Heartbeat files of the Celery worker and beat (Django-free, cheap to read).

The process writes ``<dir>/<role>.json`` every few seconds from a thread that
also checks what it depends on (broker, database); the readiness probe
(``python -m gpushare.observability.probe worker``, or ``/readyz`` on the
process's own ops port) reads it: ready means a recent heartbeat whose checks
all passed. A hung process stops writing and reads as not ready after
``max_age_s``. The directory is ``GPUSHARE_HEARTBEAT_DIR``, else
``$GPUSHARE_VAR_DIR/heartbeat`` (one pod or container per process in
Kubernetes and compose; two workers sharing a var dir would share a file).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

DEFAULT_MAX_AGE_S = 30.0


def heartbeat_dir() -> Path:
    explicit = os.environ.get("GPUSHARE_HEARTBEAT_DIR")
    if explicit:
        return Path(explicit)
    var = os.environ.get("GPUSHARE_VAR_DIR") or str(Path(__file__).resolve().parent.parent.parent / "var")
    return Path(var) / "heartbeat"


def heartbeat_write(role: str, *, ok: bool, checks: dict, directory: Path | None = None, **extra) -> Path:
    """Atomically replace ``<role>.json`` with the current state."""
    folder = directory or heartbeat_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps(
            {"role": role, "pid": os.getpid(), "at_ms": int(time.time() * 1000), "ok": ok, "checks": checks, **extra}
        )
    )
    os.replace(tmp, path)
    return path


def heartbeat_read(
    role: str, *, max_age_s: float = DEFAULT_MAX_AGE_S, directory: Path | None = None
) -> tuple[bool, dict]:
    """(ready, what the probe says): a fresh heartbeat whose checks passed."""
    path = (directory or heartbeat_dir()) / f"{role}.json"
    try:
        beat = json.loads(path.read_text())
    except FileNotFoundError:
        return False, {"ready": False, "reason": f"no heartbeat yet ({path})"}
    except (OSError, ValueError) as exc:
        return False, {"ready": False, "reason": f"unreadable heartbeat {path}: {exc}"}
    age_s = time.time() - beat.get("at_ms", 0) / 1000
    report = {"ready": False, "age_s": round(age_s, 1), "checks": beat.get("checks", {}), "pid": beat.get("pid")}
    if age_s > max_age_s:
        report["reason"] = f"heartbeat is {age_s:.0f} s old (limit {max_age_s:.0f} s): the process is stuck or gone"
        return False, report
    if not beat.get("ok"):
        failing = [name for name, result in beat.get("checks", {}).items() if result != "ok"]
        report["reason"] = f"failing: {', '.join(failing) or 'not started'}"
        return False, report
    report["ready"] = True
    return True, report
