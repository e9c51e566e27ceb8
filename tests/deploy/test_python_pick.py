"""The interpreter ``make`` builds ``.venv`` with (scripts/python_pick.py, the Makefile's ``PYTHON``): the OS's
own CPython when it can make a virtual environment, else the one the picker runs under; another choice makes
``.venv`` again."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def picker():
    spec = importlib.util.spec_from_file_location("python_pick", ROOT / "scripts" / "python_pick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_python(folder: Path, name: str, exit_code: int) -> str:
    """An executable that answers the picker's check with ``exit_code`` (0: it can make a venv)."""
    path = folder / name
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)
    return str(path)


def test_the_first_candidate_that_can_make_a_venv_is_picked(picker, tmp_path, monkeypatch):
    cannot = fake_python(tmp_path, "python3.11", 1)  # no venv or ensurepip, or older than 3.11
    can = fake_python(tmp_path, "python3.12", 0)
    also = fake_python(tmp_path, "python3.13", 0)
    monkeypatch.setattr(picker, "CANDIDATES", (str(tmp_path / "missing"), cannot, can, also))
    assert picker.pick() == can


def test_without_a_usable_candidate_the_picker_s_own_interpreter_is_picked(picker, tmp_path, monkeypatch):
    monkeypatch.setattr(picker, "CANDIDATES", (str(tmp_path / "missing"), fake_python(tmp_path, "python3.11", 1)))
    assert picker.pick() == sys.executable


def test_the_check_runs_the_candidate(picker, tmp_path):
    assert picker.usable(sys.executable)  # this interpreter: 3.11+, with venv and ensurepip
    assert not picker.usable(str(tmp_path))  # not an executable


def test_another_interpreter_makes_the_venv_again():
    # A make of its own: not a sub-make of `make test` (which would print "Entering directory" and hand down
    # its command line's variables).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON")}
    dry = subprocess.run(
        ["make", "-n", "native", "PYTHON=/opt/other/bin/python3.11"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[:2] == ["rm -rf .venv", "/opt/other/bin/python3.11 -m venv .venv"]
    assert "touch .venv/.made-with-opt-other-bin-python3.11" in lines
