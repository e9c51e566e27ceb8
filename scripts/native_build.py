"""Compile the placement core with mypyc into build/native/ (see scheduler/placement/native.py).

    python scripts/native_build.py          # build unless build/native already holds these sources' build
    python scripts/native_build.py --force  # build again

Needs mypy (requirements-dev.txt) and a C compiler; without either it says so and exits 0: the core
then runs as plain Python, slower, with the same decisions. The build goes to a fresh folder and the
manifest is written last, so an interrupted build is never taken for a finished one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEMENT = ROOT / "scheduler" / "placement"


def _native():
    """scheduler/placement/native.py loaded on its own (importing the package would load the core)."""
    spec = importlib.util.spec_from_file_location("_placement_native", PLACEMENT / "native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(out: Path, native) -> dict[str, str]:
    """Compile native.MODULES into ``out``; module name -> compiled file, relative to ``out``."""
    from mypyc.build import mypycify
    from setuptools import setup

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    paths = [str((PLACEMENT / f"{name}.py").relative_to(ROOT)) for name in native.MODULES]
    with tempfile.TemporaryDirectory(prefix="native-build-") as temp:
        extensions = mypycify(
            ["--ignore-missing-imports", "--disable-error-code", "annotation-unchecked", *paths],
            opt_level="3",
            group_name=native.GROUP,
            target_dir=str(Path(temp) / "c"),
        )
        setup(
            name="gpushare-placement-native",
            ext_modules=extensions,
            script_args=["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(Path(temp) / "o")],
        )
    folder = native.PACKAGE.replace(".", "/")
    files = {f"{native.PACKAGE}.{name}": f"{folder}/{name}{suffix}" for name in native.MODULES}
    files[f"{native.GROUP}__mypyc"] = f"{native.GROUP}__mypyc{suffix}"
    missing = [path for path in files.values() if not (out / path).is_file()]
    if missing:
        raise RuntimeError(f"the build did not produce {', '.join(missing)}")
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="build even if build/native is current")
    args = parser.parse_args()
    os.chdir(ROOT)  # mypyc names the modules after their paths from here
    native = _native()
    if not args.force and native.build_state()[0] is not None:
        print(f"placement core: compiled build in {native.BUILD} is current")
        return 0
    try:
        import mypyc  # noqa: F401
    except ImportError:
        print("placement core: mypy is not installed (requirements-dev.txt); it runs as plain Python")
        return 0
    if not shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):
        print("placement core: no C compiler; it runs as plain Python")
        return 0
    started = time.monotonic()
    digest = native.source_digest()
    native.BUILD.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="native-", dir=native.BUILD.parent))
    try:
        files = build(staging, native)
        if native.source_digest() != digest:
            raise RuntimeError("the sources changed during the build; run it again")
        (staging / native.MANIFEST).write_text(json.dumps({"digest": digest, "files": files}, indent=1))
        if native.BUILD.exists():
            shutil.rmtree(native.BUILD)
        staging.rename(native.BUILD)
    except Exception as exc:  # noqa: BLE001 - a failed build leaves the Python core in charge, loudly
        shutil.rmtree(staging, ignore_errors=True)
        print(f"placement core: the build failed ({exc}); it runs as plain Python", file=sys.stderr)
        return 1
    print(f"placement core: compiled into {native.BUILD} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
