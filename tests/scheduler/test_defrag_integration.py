"""Defragmentation with the real thing (HTTP API, Celery worker, PostgreSQL, Redis, an agent process with
simulated GPUs) on `make run`'s fleet: slices spread over the two H100s are drained with their grace period,
placed again on the L4s, and a 2 x H100 job that waited only on their spread starts."""

from __future__ import annotations

import pytest
from django_scopes import scopes_disabled

from scheduler.models import Allocation, Job, JobEvent, JobMove, JobState, PriorityClass
from scheduler.rules import priority_class_update
from tests.factories import TenantFactory, wait_for
from tests.scheduler.integration_helpers import models_of, submit

pytestmark = pytest.mark.integration


def gpu_of(job_id: int) -> str:
    with scopes_disabled():
        return Allocation.objects.get(job_id=job_id, released_at__isnull=True).gpu.uuid


def state(job_id: int) -> str:
    with scopes_disabled():
        return Job.objects.get(pk=job_id).state


def test_spread_slices_are_moved_off_the_h100s_and_the_two_h100_job_starts(platform, agent_factory):
    # Rules for this test: the standard class may not preempt (only a move can free the H100s), and
    # preemptible jobs may be disturbed at once, with a 2 s grace period.
    with scopes_disabled():
        preemptible = PriorityClass.objects.get(name="preemptible")
        standard = PriorityClass.objects.get(name="standard")
    priority_class_update(actor=None, priority_class=standard, changes={"may_preempt": []})
    priority_class_update(actor=None, priority_class=preemptible, changes={"min_runtime_s": 0, "grace_period_s": 2})
    agent_factory("sim-node-1", gpus="sim:2xH100-80GB,2xL4-24GB")  # make run's node
    session = platform.session_for(TenantFactory(slug="acme"))

    # The L4s are busy when four 1/2 slices arrive: they fill both H100s. Then one slice on each H100 ends
    # and the L4s free up: two 1/2 slices are left, one on each H100.
    l4_jobs = [submit(platform, session, kind="training", gpus=1, gpu_model="L4-24GB") for _ in range(2)]
    wait_for(lambda: all(models_of(j) == ["L4-24GB"] for j in l4_jobs), timeout=60, what="the L4 jobs")
    four = [submit(platform, session, kind="inference", gpus=0.5, priority="preemptible") for _ in range(4)]
    wait_for(lambda: all(state(j) == JobState.RUNNING for j in four), timeout=60, what="the slices to run")
    by_gpu: dict[str, list[int]] = {}
    for job_id in four:
        by_gpu.setdefault(gpu_of(job_id), []).append(job_id)
    assert sorted(len(jobs) for jobs in by_gpu.values()) == [2, 2]
    slices = sorted(jobs[0] for jobs in by_gpu.values())
    for job_id in [*l4_jobs, *(jobs[1] for jobs in by_gpu.values())]:
        session.post(f"{platform.url}/api/v1/jobs/{job_id}/cancel/", timeout=15)
    ended = [j for j in four if j not in slices] + l4_jobs
    wait_for(lambda: all(not models_of(j) for j in ended), timeout=60, what="the L4s and half the H100s to free up")
    assert [models_of(j) for j in slices] == [["H100-80GB"], ["H100-80GB"]]

    training = submit(platform, session, kind="training", gpus=2, gpu_model="H100-80GB")
    wait_for(lambda: state(training) in (JobState.SCHEDULED, JobState.RUNNING), timeout=90, what="the 2 x H100 job")
    assert models_of(training) == ["H100-80GB", "H100-80GB"]
    # The moved slices run again, on the L4s.
    wait_for(
        lambda: all(state(j) == JobState.RUNNING and models_of(j) == ["L4-24GB"] for j in slices),
        timeout=60,
        what="the moved slices to run on the L4s",
    )
    with scopes_disabled():
        assert sorted(JobMove.objects.values_list("job_id", "for_job_id")) == [(j, training) for j in sorted(slices)]
        reason = JobMove.objects.first().reason
        assert reason.startswith("defragmentation: 2 slice(s)") and f"job {training} (2 x H100-80GB)" in reason
        assert JobEvent.objects.filter(job_id=training, detail=reason).count() == 1
        for job_id in slices:
            details = list(JobEvent.objects.filter(job_id=job_id).values_list("to_state", "detail"))
            asked = f"moved to free GPUs for job {training} (defragmentation); queued again once stopped"
            at = details.index((JobState.RUNNING, asked))  # asked to stop, with the grace period; then:
            assert details[at + 1 :] == [
                (JobState.PREEMPTED, asked),
                (JobState.QUEUED, "requeued to be placed again (moved to free GPUs: defragmentation)"),
                (JobState.SCHEDULED, f"placed on sim-node-1 ({gpu_of(job_id)})"),
                (JobState.RUNNING, "started on sim-node-1"),
            ]
            assert Job.objects.get(pk=job_id).attempt == 2
    for job_id in (*slices, training):
        session.post(f"{platform.url}/api/v1/jobs/{job_id}/cancel/", timeout=15)
