"""The compiled placement core (scheduler/placement/native.py): used only when built from exactly the
sources on disk, and the plain Python core it stands in for makes the same decisions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from scheduler.placement import native

ROOT = Path(__file__).resolve().parents[2]


def _sources_copy(tmp_path: Path) -> Path:
    root = tmp_path / "placement"
    root.mkdir()
    for name in native.MODULES:
        shutil.copy(native.HERE / f"{name}.py", root / f"{name}.py")
    return root


def _build_of(tmp_path: Path, root: Path) -> Path:
    build = tmp_path / "build"
    (build / "lib").mkdir(parents=True)
    files = {f"{native.PACKAGE}.{name}": f"lib/{name}.so" for name in native.MODULES}
    for path in files.values():
        (build / path).write_bytes(b"")
    (build / native.MANIFEST).write_text(json.dumps({"digest": native.source_digest(root), "files": files}))
    return build


def test_a_build_is_used_only_for_the_sources_it_was_built_from(tmp_path):
    root = _sources_copy(tmp_path)
    assert native.build_state(tmp_path / "none", root) == (None, "not built (make native)")
    build = _build_of(tmp_path, root)
    files, why = native.build_state(build, root)
    assert why is None and files[f"{native.PACKAGE}.fleet"] == build / "lib" / "fleet.so"
    # One character edited in one module after the build: the whole build is refused (all or none).
    fleet = root / "fleet.py"
    fleet.write_text(fleet.read_text().replace("CANDIDATES_PER_BUCKET = 3", "CANDIDATES_PER_BUCKET = 4"))
    files, why = native.build_state(build, root)
    assert files is None and why.startswith("built from other sources")


def test_a_build_with_a_compiled_file_missing_is_refused(tmp_path):
    root = _sources_copy(tmp_path)
    build = _build_of(tmp_path, root)
    (build / "lib" / "core.so").unlink()
    files, why = native.build_state(build, root)
    assert files is None and "core.so" in why


def _core_in_child(**env) -> str:
    code = "import scheduler.placement.native as n, scheduler.placement; print(n.compiled(), n.reason)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_core_in_use_is_the_one_its_build_state_says():
    files, why = native.build_state()
    if files is not None:  # make test builds it first wherever a C compiler is
        assert native.compiled() and native.reason is None
        assert _core_in_child() == "True None"
    else:
        assert not native.compiled() and native.reason == why
    assert _core_in_child(GPUSHARE_PLACEMENT_NATIVE="0") == "False turned off (GPUSHARE_PLACEMENT_NATIVE=0)"


def test_the_plain_python_core_passes_the_placement_tests_too():
    """The suite runs the compiled core when it is built; the Python one (make run, machines without a
    compiler) must make the same decisions: the recorded ones, the properties, the scarcity rules."""
    files = [
        "tests/scheduler/test_placement_same_decisions.py",
        "tests/scheduler/test_placement.py",
        "tests/scheduler/test_placement_properties.py",
        "tests/scheduler/test_placement_scarcity.py",
        "tests/scheduler/test_defrag.py",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env={**os.environ, "GPUSHARE_PLACEMENT_NATIVE": "0"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
