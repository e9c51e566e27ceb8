"""The core compiled to C with mypyc, used only when it was built from exactly these sources.

``python scripts/native_build.py`` (run by ``make test``, ``make bench`` and ``make native``) compiles
the modules in :data:`MODULES` into ``build/native/``, with a manifest naming the digest of the sources it
compiled. At import, :func:`install` compares that digest with the sources on disk: equal, the
compiled modules are loaded in place of the ``.py`` files (same names, same decisions, 1.5-2x the
speed); anything else (not built, built from an older edit, no C compiler on this machine,
``GPUSHARE_PLACEMENT_NATIVE=0``) leaves the plain Python modules in charge. A stale build can never
shadow an edit, and nothing outside this package changes: the compiled modules are the same code.

This module is not compiled itself and imports nothing of the package.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "scheduler.placement"
# Compiled together (one shared library: they call each other natively, so it is all or none).
MODULES = ("data", "score", "fleet", "core", "timeline", "preempt", "fairshare", "defrag")
GROUP = "gpushare_placement"  # the shared library's module name is GROUP + "__mypyc"
HERE = Path(__file__).resolve().parent
BUILD = HERE.parent.parent / "build" / "native"  # in the checkout, ignored by git
MANIFEST = "manifest.json"

# Why the plain Python modules run (None: the compiled ones do); set by install().
reason: str | None = "not checked yet"


def source_digest(root: Path = HERE) -> str:
    """The digest a build is valid for: the sources and the interpreter (its version and ABI). The
    compiler's version is not in it: a build carries its own runtime, so an older mypyc's build of the
    same sources is still the same code (``make native`` rebuilds when requirements-dev.txt changes)."""
    digest = hashlib.sha256()
    digest.update(f"{sys.version}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    for name in MODULES:
        digest.update(name.encode() + b"\0" + (root / f"{name}.py").read_bytes() + b"\0")
    return digest.hexdigest()


def build_state(build: Path = BUILD, root: Path = HERE) -> tuple[dict[str, Path] | None, str | None]:
    """``(module name -> compiled file, None)`` when ``build`` holds a build of the sources in ``root``,
    else ``(None, why not)``."""
    try:
        manifest = json.loads((build / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "not built (make native)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest: {exc}"
    if manifest.get("digest") != source_digest(root):
        return None, "built from other sources (an edit since the build: make native)"
    files = {name: build / path for name, path in manifest.get("files", {}).items()}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing or not files:
        return None, f"compiled files missing: {', '.join(missing) or 'none listed'}"
    return files, None


class _Finder:
    """A meta-path finder that answers for the compiled modules only."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def find_spec(self, fullname, path=None, target=None):
        found = self.files.get(fullname)
        if found is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(found))
        return importlib.util.spec_from_file_location(fullname, found, loader=loader)


def install(build: Path = BUILD) -> str | None:
    """Load the compiled modules from now on when ``build`` is current; the reason they are not, or None."""
    global reason
    if os.environ.get("GPUSHARE_PLACEMENT_NATIVE", "1") == "0":
        reason = "turned off (GPUSHARE_PLACEMENT_NATIVE=0)"
        return reason
    files, reason = build_state(build)
    if files is not None:
        sys.meta_path.insert(0, _Finder(files))
    elif build.exists():
        log.warning("placement core: the compiled build in %s is not used: %s", build, reason)
    return reason


def compiled() -> bool:
    """Whether the core running in this process is the compiled one."""
    module = sys.modules.get(f"{PACKAGE}.fleet")
    return module is not None and not str(getattr(module, "__file__", "")).endswith(".py")
