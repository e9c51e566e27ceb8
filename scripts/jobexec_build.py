"""Build the node agent's launch helper (agents/agent/jobexec.c) into build/agent/gpushare-jobexec.

    python scripts/jobexec_build.py          # build unless build/agent holds this source's build
    python scripts/jobexec_build.py --force  # build again

Needs a C compiler; without one it says so and exits 0: the agent then drops a job's privileges in Python
(agents/agent/jobexec.py says what that costs). The binary is written under a temporary name and renamed
into place with its source's digest beside it, so an interrupted build is never taken for a finished one.
The folder and the binary are 0755: the agent refuses a helper that others could replace.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _jobexec():
    """agents/agent/jobexec.py loaded on its own (it names the source and the build; the agent finds the
    helper there), without importing the agent package."""
    spec = importlib.util.spec_from_file_location("_agent_jobexec", ROOT / "agents" / "agent" / "jobexec.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_paths = _jobexec()
SOURCE, BUILD, BINARY = _paths.SOURCE, _paths.BUILD, _paths.BUILT
DIGEST = BINARY.with_name(BINARY.name + ".sha256")
FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="build even if the build is current")
    args = parser.parse_args()
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    if not args.force and BINARY.is_file() and DIGEST.is_file() and DIGEST.read_text().strip() == digest:
        print(f"launch helper: the build in {BINARY} is current")
        return 0
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        print("launch helper: no C compiler; the agent drops job privileges in Python (~2 ms more a launch)")
        return 0
    BUILD.mkdir(parents=True, exist_ok=True)
    BUILD.chmod(0o755)
    staging = BUILD / f".{BINARY.name}.{os.getpid()}"
    result = subprocess.run([compiler, *FLAGS, "-o", str(staging), str(SOURCE)], capture_output=True, text=True)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        print(f"launch helper: the build failed:\n{result.stderr}", file=sys.stderr)
        return 1
    staging.chmod(0o755)
    DIGEST.unlink(missing_ok=True)
    staging.rename(BINARY)
    DIGEST.write_text(digest + "\n")
    print(f"launch helper: built {BINARY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
