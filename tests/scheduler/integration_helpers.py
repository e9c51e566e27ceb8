"""What the scheduler's real-agent tests share: submitting a job that holds its GPUs, and where it sits."""

from __future__ import annotations

import sys

from django_scopes import scopes_disabled

from scheduler.models import Allocation

HOLD = [sys.executable, "-c", "import time; time.sleep(120)"]  # holds its GPUs until stopped


def submit(platform, session, **body) -> int:
    """Submit ``body`` (with HOLD as its command) through the API; the job's id."""
    response = session.post(f"{platform.url}/api/v1/jobs/", json={"command": HOLD, **body}, timeout=15)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def models_of(job_id: int) -> list[str]:
    """The GPU models the job holds now."""
    with scopes_disabled():
        rows = Allocation.objects.filter(job_id=job_id, released_at__isnull=True)
        return sorted(rows.values_list("gpu__model", flat=True))
