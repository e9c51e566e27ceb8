"""The web and worker processes freeze what they keep once loaded (gpushare/heap.py): the garbage
collector's full walks then skip ~140,000 objects (70-180 ms a walk on the bench machine)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.processes import ROOT, process_env

REPORT = "import gc, json; print(json.dumps([gc.get_freeze_count(), len(gc.get_objects())]))"


def heap_after(code: str) -> tuple[int, int]:
    """(objects frozen, objects the collector still walks) in a fresh process after ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\n{REPORT}"], cwd=ROOT, env=process_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    frozen, walked = json.loads(out.stdout.strip().splitlines()[-1])
    return frozen, walked


def test_the_web_application_is_frozen_once_loaded_views_included():
    frozen, walked = heap_after("import gpushare.wsgi")
    assert frozen > 50_000
    assert walked < frozen / 20
    # the URL conf (every view and serializer) was loaded before the freeze, not left to the first request
    _, walked_after_urls = heap_after(
        "import gpushare.wsgi\nfrom django.urls import get_resolver\nget_resolver().url_patterns"
    )
    assert walked_after_urls < frozen / 20


def test_a_worker_and_each_of_its_pools_children_freeze_what_they_keep():
    frozen, _ = heap_after("import django; django.setup()\nimport gpushare.celery")
    assert frozen == 0  # importing the app freezes nothing: a shell, a command or a test keeps its collector
    for signal in ("worker_init", "worker_process_init"):
        frozen, walked = heap_after(
            f"import django; django.setup()\nimport gpushare.celery\nfrom celery import signals\n"
            f"signals.{signal}.send(sender=None)"
        )
        assert frozen > 50_000 and walked < frozen / 20, (signal, frozen, walked)
