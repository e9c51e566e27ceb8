"""The scheduling pass on PostgreSQL: bulk reads, one transaction, reasons, preemption bookkeeping."""

from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_scopes import scopes_disabled

from scheduler.models import Allocation, Job, JobEvent, JobState, TenantShare
from scheduler.services import job_exited, job_started, schedule_pass
from tests.scheduler.conftest import node_add, reload, submit


def held(job) -> list[str]:
    return list(
        Allocation.objects.filter(job_id=job.pk, released_at__isnull=True)
        .order_by("gpu__index")
        .values_list("gpu__uuid", flat=True)
    )


def test_pass_places_gangs_and_packs_slices(sched, tenant):
    node_add("n1", 4)
    gang = submit(tenant, gpus=2)
    slices = [submit(tenant, gpus=0.25) for _ in range(5)]
    result = schedule_pass()
    assert result.placed == 6
    assert len(held(reload(gang))) == 2 and reload(gang).state == JobState.SCHEDULED
    gpus = [held(j)[0] for j in slices]
    assert len(set(gpus[:4])) == 1 and gpus[4] != gpus[0]
    assert set(gpus).isdisjoint(held(gang))
    assert reload(gang).attempt == 1 and reload(gang).isolation == "exclusive"
    with scopes_disabled():
        assert JobEvent.objects.filter(job=gang, to_state=JobState.SCHEDULED).count() == 1


def test_pending_reasons_and_estimates_are_written(sched, tenant):
    node_add("n1", 2)
    running = submit(tenant, gpus=2, max_runtime_s=600)
    schedule_pass()
    waiting = submit(tenant, gpus=2)
    impossible = submit(tenant, gpus=1, gpu_model="A100")
    schedule_pass()
    waiting, impossible = reload(waiting), reload(impossible)
    assert waiting.pending_reason == "waiting for 2 free whole GPU(s) on one node"
    expected = reload(running).scheduled_at + timedelta(seconds=600)
    assert abs(waiting.estimated_start_at - expected) < timedelta(seconds=2)
    assert impossible.pending_reason == "no schedulable A100 GPU in the fleet"
    assert impossible.estimated_start_at is None


def test_query_count_does_not_grow_with_the_queue(sched, tenant, other_tenant):
    node_add("n1", 8)
    node_add("n2", 8)

    def queries_for(n: int) -> int:
        for i in range(n):
            submit(tenant if i % 2 else other_tenant, gpus=0.125 if i % 3 else 1)
        with CaptureQueriesContext(connection) as ctx:
            schedule_pass()
        return len(ctx.captured_queries)

    small = queries_for(5)
    with scopes_disabled():
        Job.objects.all().delete()
    Allocation.objects.all().delete()
    large = queries_for(60)
    assert large <= small + 2, (small, large)


def test_tenant_weights_order_the_queue(sched, tenant, other_tenant):
    node_add("n1", 4)
    with scopes_disabled():
        TenantShare.objects.create(tenant=tenant, weight=1)
        TenantShare.objects.create(tenant=other_tenant, weight=3)
    for _ in range(8):
        submit(tenant, gpus=1)
    for _ in range(8):
        submit(other_tenant, gpus=1)
    schedule_pass()
    with scopes_disabled():
        placed = Job.objects.filter(state=JobState.SCHEDULED)
        assert placed.filter(tenant=tenant).count() == 1
        assert placed.filter(tenant=other_tenant).count() == 3


def test_preemption_marks_victims_then_requeues_and_counts_them(sched, tenant, other_tenant):
    node = node_add("n1", 2)
    low = [submit(other_tenant, gpus=1, priority="preemptible") for _ in range(2)]
    schedule_pass()
    long_ago = timezone.now() - timedelta(minutes=5)
    with scopes_disabled():
        Job.objects.filter(pk__in=[j.pk for j in low]).update(started_at=long_ago, state=JobState.RUNNING)
    high = submit(tenant, gpus=1, priority="standard")
    result = schedule_pass()
    assert result.preempted == 1
    victims = [j for j in map(reload, low) if j.stop_requested == "preempt"]
    assert len(victims) == 1
    assert victims[0].stop_reason == f"preempted for job {high.pk} (standard)"
    assert reload(high).pending_reason == "preempting 1 lower-priority job(s) to make room"
    # Next pass while the victim is still stopping: nothing more is preempted.
    assert schedule_pass().preempted == 0
    assert reload(high).pending_reason == "waiting for preempted lower-priority jobs to stop"
    victim = victims[0]
    now_ms = int(timezone.now().timestamp() * 1000)
    job_exited(node=node, job_id=victim.pk, attempt=victim.attempt, exit_code=-15, at_ms=now_ms)
    victim = reload(victim)
    assert victim.state == JobState.QUEUED and victim.preemption_count == 1 and victim.stop_requested == ""
    with scopes_disabled():
        states = list(JobEvent.objects.filter(job=victim).values_list("to_state", flat=True))
    assert states[-2:] == [JobState.PREEMPTED, JobState.QUEUED]
    schedule_pass()
    assert reload(high).state == JobState.SCHEDULED
    assert reload(victim).state == JobState.QUEUED


def test_young_victims_are_spared_by_min_runtime(sched, tenant, other_tenant):
    node_add("n1", 1)
    low = submit(other_tenant, gpus=1, priority="preemptible")  # the class's min runtime is 60 s
    schedule_pass()
    job_started(node=reload(low).node, job_id=low.pk, attempt=1, at_ms=int(timezone.now().timestamp() * 1000))
    high = submit(tenant, gpus=1, priority="standard")
    assert schedule_pass().preempted == 0
    assert reload(high).pending_reason == "waiting for 1 free whole GPU(s) on one node"


def test_a_cancelled_job_is_never_placed(sched, tenant):
    from scheduler.services import job_cancel

    node_add("n1", 1)
    job = submit(tenant, gpus=1)
    job_cancel(job=job)
    schedule_pass()
    assert reload(job).state == JobState.CANCELLED
    assert not held(job)
