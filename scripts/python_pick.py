"""Which CPython ``make`` builds ``.venv`` with: prints its path (the Makefile's ``PYTHON``).

The operating system's own CPython (3.11, else 3.12 or 3.13) when it has one that can make a virtual environment
(``venv`` and ``ensurepip``: Debian's ``python3-venv``), else the interpreter this runs under.

Why: distributions build their CPython with profile-guided and link-time optimisation, and so does the
official Docker image the ``Dockerfile`` starts from. A version manager's default build (pyenv's, say) does
neither. On the bench machine pyenv's 3.11 spent 20-30% more CPU on a submit, a job list page or a job
detail than Debian's 3.11 (docs/benchmarks.md, "Session 27"), so tests and benchmarks on it measured a slower
server than the one deployed. ``make PYTHON=/path/to/python3`` still picks another, and ``.venv`` is made again when the
choice changes (the Makefile's ``VENV_MADE``).

Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import subprocess
import sys

# The operating system's places; the Dockerfile's version (3.11) first. /usr/local/bin: the official image's.
CANDIDATES = tuple(f"{prefix}/python3.{minor}" for minor in (11, 12, 13) for prefix in ("/usr/bin", "/usr/local/bin"))
CAN_MAKE_A_VENV = "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))"


def usable(path: str) -> bool:
    try:
        return subprocess.run([path, "-c", CAN_MAKE_A_VENV], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pick() -> str:
    return next((path for path in CANDIDATES if usable(path)), sys.executable)


if __name__ == "__main__":
    print(pick())
