"""The scheduler with the real thing: HTTP API, a Celery worker process, node
agent processes (simulated GPUs), PostgreSQL and Redis."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django_scopes import scopes_disabled

from billing.models import UsageWindow
from scheduler.models import Allocation, Job, JobEvent, JobLogChunk, JobState, PriorityClass
from scheduler.rules import priority_class_update, scheduler_settings_update, tenant_weight_set
from scheduler.services import schedule_pass
from tests.factories import TenantFactory, wait_for
from tests.scheduler.conftest import node_add

pytestmark = pytest.mark.integration


def has_windows(job_id: int, **filters) -> bool:
    with scopes_disabled():
        return UsageWindow.objects.filter(job_id=job_id, **filters).exists()


def sleeper(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def submit(platform, session, *, gpus=1, kind=None, command=None, **extra) -> int:
    kind = kind or ("training" if float(gpus).is_integer() else "inference")
    body = {"kind": kind, "gpus": gpus, "command": command or sleeper(1), **extra}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=15)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def job(job_id: int) -> Job:
    with scopes_disabled():
        return Job.objects.select_related("node").get(pk=job_id)


def wait_state(job_id: int, *states: str, timeout: float = 60) -> Job:
    return wait_for(
        lambda: (j := job(job_id)).state in states and j, timeout=timeout, what=f"job {job_id} to reach {states}"
    )


def gpus_of(job_id: int) -> list[str]:
    """The GPUs of the job's latest placement."""
    scheduled_at = job(job_id).scheduled_at
    rows = Allocation.objects.filter(job_id=job_id, created_at__gte=scheduled_at)
    return sorted(rows.values_list("gpu__uuid", flat=True))


def test_higher_class_starts_first_and_pending_reason_is_visible(platform, agent_factory):
    agent_factory("node-1", gpus="sim:1xH100-80GB")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    blocker = submit(platform, session, command=sleeper(3), priority="standard")
    wait_state(blocker, JobState.RUNNING)
    low = submit(platform, session, priority="preemptible")
    high = submit(platform, session, priority="standard")
    body = wait_for(
        lambda: (
            (b := session.get(f"{platform.url}/api/v1/jobs/{low}/", timeout=10).json())["pending_reason"].startswith(
                "waiting for 1 free"
            )
            and b
        ),
        what="the pending reason of the low job",
    )
    assert body["state"] == "queued" and body["estimated_start"] is not None
    wait_state(high, JobState.SUCCEEDED)
    low_done = wait_state(low, JobState.SUCCEEDED)
    assert job(high).started_at < low_done.started_at
    assert low_done.preemption_count == 0


def test_gang_goes_whole_onto_the_best_fitting_node(platform, agent_factory):
    agent_factory("node-a", gpus="sim:2xH100-80GB,2xL4-24GB")
    agent_factory("node-b", gpus="sim:4xH100-80GB")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    two = submit(platform, session, gpus=2, gpu_model="H100-80GB", command=sleeper(4))
    assert wait_state(two, JobState.RUNNING, JobState.SUCCEEDED).node.name == "node-a"
    four = submit(platform, session, gpus=4, gpu_model="H100-80GB", command=sleeper(1))
    placed = wait_state(four, JobState.SUCCEEDED)
    assert placed.node.name == "node-b"
    with scopes_disabled():
        uuids = gpus_of(four)
    assert len(uuids) == 4
    assert set(uuids) == set(placed.node.gpus.values_list("uuid", flat=True))


def test_four_quarter_slices_share_one_gpu_before_another_opens(platform, agent_factory):
    agent_factory("node-1", gpus="sim:2xL4-24GB")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    ids = [submit(platform, session, gpus=0.25, command=sleeper(4)) for _ in range(5)]
    for job_id in ids:
        wait_state(job_id, JobState.RUNNING, JobState.SUCCEEDED)
    with scopes_disabled():
        where = {job_id: gpus_of(job_id)[0] for job_id in ids}
    per_gpu = defaultdict(list)
    for job_id, uuid in where.items():
        per_gpu[uuid].append(job_id)
    assert sorted(len(v) for v in per_gpu.values()) == [1, 4]
    assert per_gpu[where[ids[4]]] == [ids[4]]  # the fifth opened the second GPU
    for job_id in ids:
        assert wait_state(job_id, JobState.SUCCEEDED).isolation != "exclusive"


def test_backfill_starts_only_what_does_not_delay_the_head(platform, agent_factory):
    agent_factory("node-1", gpus="sim:2xL4-24GB")
    tenant = TenantFactory(slug="acme")
    session = platform.session_for(tenant)
    blocker = submit(platform, session, command=sleeper(10), max_runtime_seconds=60)
    wait_state(blocker, JobState.RUNNING)
    head = submit(platform, session, gpus=2, command=sleeper(1), max_runtime_seconds=60)
    long = submit(platform, session, command=sleeper(1), max_runtime_seconds=3600)
    short = submit(platform, session, command=sleeper(1), max_runtime_seconds=20)
    wait_state(short, JobState.SUCCEEDED)
    reason = wait_for(
        lambda: job(long).pending_reason.startswith("would delay") and job(long).pending_reason,
        what="the long job's pending reason",
    )
    assert reason == f"would delay job {head}, ahead in the queue, which has the free GPUs reserved (backfill)"
    assert job(long).state == JobState.QUEUED
    head_done = wait_state(head, JobState.SUCCEEDED)
    long_done = wait_state(long, JobState.SUCCEEDED)
    assert job(short).finished_at <= head_done.started_at
    assert head_done.started_at < long_done.started_at


TERM_AWARE = (
    "import os, signal, sys, time\n"
    "def bye(*_):\n"
    "    time.sleep(0.5)\n"
    "    print('cleaned up after SIGTERM', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('attempt', os.environ['GPUSHARE_ATTEMPT'], flush=True)\n"
    "time.sleep(30 if os.environ['GPUSHARE_ATTEMPT'] == '1' else 1)\n"
)


def test_preemption_with_grace_requeue_and_billing(platform, agent_factory):
    agent_factory("node-1", gpus="sim:1xH100-80GB")
    priority_class_update(
        actor=None,
        priority_class=PriorityClass.objects.get(name="preemptible"),
        changes={"min_runtime_s": 0, "grace_period_s": 5},
    )
    batch_tenant, prod_tenant = TenantFactory(slug="batch"), TenantFactory(slug="prod")
    low = submit(
        platform, platform.session_for(batch_tenant), priority="preemptible", command=[sys.executable, "-c", TERM_AWARE]
    )
    wait_state(low, JobState.RUNNING)
    wait_for(lambda: has_windows(low), what="a usage window of the low job")
    high = submit(platform, platform.session_for(prod_tenant), priority="standard", command=sleeper(1))
    wait_state(high, JobState.SUCCEEDED)
    low_done = wait_state(low, JobState.SUCCEEDED)
    assert low_done.preemption_count == 1 and low_done.attempt == 2
    with scopes_disabled():
        events = list(JobEvent.objects.filter(job_id=low).values_list("from_state", "to_state", "detail"))
        log = b"".join(bytes(c.data) for c in JobLogChunk.objects.filter(job_id=low).order_by("offset")).decode()
        preempted_at = JobEvent.objects.get(job_id=low, to_state=JobState.PREEMPTED).at
    states = [to for before, to, _ in events if before != to]
    notes = [detail for before, to, detail in events if before == to]
    assert states[:6] == ["queued", "scheduled", "running", "preempted", "queued", "scheduled"], states
    assert notes == [f"preempted for job {high} (standard)"]
    assert "cleaned up after SIGTERM" in log  # SIGTERM first, the grace period let it finish
    assert job(high).started_at >= preempted_at - timedelta(seconds=1)  # the GPU was free only then
    assert has_windows(low, attempt=1) and has_windows(low, attempt=2)
    assert low_done.cost > 0  # both attempts are billed


def test_fair_share_between_weights_1_and_3(platform, agent_factory):
    scheduler_settings_update(actor=None, fair_share_half_life_s=20)
    light, heavy = TenantFactory(slug="light"), TenantFactory(slug="heavy")
    tenant_weight_set(actor=None, tenant=light, weight=1)
    tenant_weight_set(actor=None, tenant=heavy, weight=3)
    sessions = {light: platform.session_for(light), heavy: platform.session_for(heavy)}
    ids = {light: [], heavy: []}
    for _ in range(30):
        for tenant in (light, heavy):
            ids[tenant].append(submit(platform, sessions[tenant], command=sleeper(1.5)))
    agent_factory("node-1", gpus="sim:8xL4-24GB")  # the backlog is there before the GPUs are
    # Measure while both tenants still have work queued: until the heavy tenant's last job starts.
    last_heavy = wait_state(ids[heavy][-1], JobState.RUNNING, JobState.SUCCEEDED, timeout=120)
    cut = last_heavy.started_at
    with scopes_disabled():
        started = Job.objects.filter(started_at__lte=cut, tenant__in=[light, heavy])
        gpu_s = {
            t: sum((min(j.finished_at or cut, cut) - j.started_at).total_seconds() for j in started.filter(tenant=t))
            for t in (light, heavy)
        }
        counts = {t: started.filter(tenant=t).count() for t in (light, heavy)}
    share = gpu_s[light] / (gpu_s[light] + gpu_s[heavy])
    print(f"fair share measured: light {share:.3f} heavy {1 - share:.3f} (jobs started {counts})")
    assert abs(share - 0.25) <= 0.10, (share, counts)
    for job_id in ids[light] + ids[heavy]:  # leave nothing running behind the test
        wait_state(job_id, JobState.SUCCEEDED, timeout=120)


def test_concurrent_passes_never_double_place(transactional_db, rules, monkeypatch):
    """Four threads (four connections) submit and run passes at once: the lock serialises the passes."""
    from scheduler.services import JobSpec, job_submit

    # Only this test's threads run passes (no worker from an earlier test joins in while the tables are flushed).
    monkeypatch.setattr("scheduler.passes.pass_request", lambda **_: None)

    node_add("n1", 3)
    tenant = TenantFactory(slug="acme")
    barrier = threading.Barrier(4)
    errors = []

    def run(worker: int):
        try:
            barrier.wait()
            for i in range(6):
                shared = (worker + i) % 2
                job_submit(
                    tenant=tenant,
                    user=None,
                    spec=JobSpec(
                        kind="inference" if shared else "training", gpu_milli=500 if shared else 1000, command=["true"]
                    ),
                )
                schedule_pass()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    per_gpu = defaultdict(list)
    per_job = defaultdict(int)
    for gpu, job_id, share in Allocation.objects.filter(released_at__isnull=True).values_list(
        "gpu_id", "job_id", "share_milli"
    ):
        per_gpu[gpu].append(share)
        per_job[job_id] += 1
    assert len(per_gpu) == 3
    for shares in per_gpu.values():
        assert sum(shares) <= 1000 and (1000 not in shares or len(shares) == 1), per_gpu
    assert max(per_job.values()) == 1  # every job holds one GPU: placed once
    with scopes_disabled():
        assert Job.objects.filter(tenant=tenant, state=JobState.SCHEDULED).count() == len(per_job)
        assert JobEvent.objects.filter(tenant=tenant, to_state=JobState.SCHEDULED).count() == len(per_job)
