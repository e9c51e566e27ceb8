"""The domain apps point one way, and a missing admission rule stops the platform instead of admitting all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from django.core.exceptions import ImproperlyConfigured

from gpushare import ports
from scheduler import admission as scheduler_port
from scheduler.services import JobSpec, job_submit
from tests.processes import ROOT, process_env

BIN = ROOT / ".venv" / "bin"


def test_the_import_contracts_hold():
    """What `make test` runs: .importlinter (layers of the domain apps; the limit arithmetic is pure)."""
    done = subprocess.run([str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout and "ignored" not in done.stdout


def test_every_port_is_provided_once_the_apps_are_ready():
    assert ports.missing() == []


@pytest.mark.django_db
def test_without_an_admission_provider_a_submit_fails_closed(rules, tenant, monkeypatch):
    monkeypatch.setattr(scheduler_port.job_admit, "_provider", None)
    with pytest.raises(ImproperlyConfigured, match="scheduler.job_admit"):
        job_submit(tenant=tenant, user=None, spec=JobSpec(kind="training", gpu_milli=1000, command=["true"]))


@pytest.mark.django_db
def test_without_a_caps_provider_the_scheduling_pass_fails_instead_of_dropping_every_cap(monkeypatch):
    from scheduler.passes import _tenant_limits

    monkeypatch.setattr(scheduler_port.tenant_caps, "_provider", None)
    with pytest.raises(ImproperlyConfigured, match="scheduler.tenant_caps"):
        _tenant_limits()


def test_a_platform_without_the_admission_app_does_not_start(tmp_path):
    """Settings that leave the admission app out: `manage.py check` (and so runserver, migrate) refuses."""
    (tmp_path / "no_admission.py").write_text(
        textwrap.dedent(
            """
            from gpushare.settings.test import *  # noqa: F403
            INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "admission"]  # noqa: F405
            """
        )
    )
    env = process_env({"DJANGO_SETTINGS_MODULE": "no_admission", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "nothing provides the port scheduler.job_admit" in done.stderr + done.stdout
