"""Defragmentation through the scheduling pass on PostgreSQL: the moves are drained like preemptions, recorded
in the timelines and the waiting job's why-pending and estimate, and the freed cards are kept for it."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from django_scopes import scopes_disabled

from agents.models import Gpu
from scheduler.models import Allocation, Job, JobEvent, JobMove, JobState, PriorityClass
from scheduler.rules import priority_class_update, scheduler_settings_update
from scheduler.services import job_exited, schedule_pass
from tests.scheduler.conftest import node_add, reload, submit


def make_run_fleet():
    """`make run`'s node: 2 x H100 then 2 x L4."""
    node = node_add("sim-node-1", 2, "H100-80GB")
    Gpu.objects.bulk_create(
        Gpu(node=node, uuid=f"GPU-sim-node-1-{i}", index=i, model="L4-24GB", memory_mb=24576) for i in (2, 3)
    )
    return node


def held(job) -> list[str]:
    return list(
        Allocation.objects.filter(job_id=job.pk, released_at__isnull=True)
        .order_by("gpu__index")
        .values_list("gpu__uuid", flat=True)
    )


def now_ms() -> int:
    return int(timezone.now().timestamp() * 1000)


def spread_slices(node, tenant, other_tenant):
    """Two preemptible 1/2 slices, one on each H100 (placed while the L4s were busy), running for 5 minutes;
    the L4s free again. The standard class may not preempt here: only a move can free the H100s."""
    standard = PriorityClass.objects.get(name="standard")
    priority_class_update(actor=None, priority_class=standard, changes={"may_preempt": []})
    l4_holders = [submit(tenant, gpus=1, gpu_model="L4-24GB") for _ in range(2)]
    slices = [submit(other_tenant, gpus=0.5, priority="preemptible") for _ in range(2)]
    schedule_pass()
    first, second = slices
    h100s = ["GPU-sim-node-1-0", "GPU-sim-node-1-1"]
    # the second slice joined the first on its card (best fit): put it on the other H100, as if placed there
    Allocation.objects.filter(job_id=second.pk).update(
        gpu=Gpu.objects.get(uuid=next(u for u in h100s if u not in held(first)))
    )
    assert sorted(held(first) + held(second)) == h100s
    long_ago = timezone.now() - timedelta(minutes=5)
    with scopes_disabled():
        Job.objects.filter(pk__in=[j.pk for j in slices]).update(started_at=long_ago, state=JobState.RUNNING)
    for job in l4_holders:
        job_exited(node=node, job_id=job.pk, attempt=1, exit_code=0, at_ms=now_ms())
    return slices, h100s


def test_slices_spread_over_the_h100s_are_moved_and_the_gang_starts(sched, tenant, other_tenant):
    node = make_run_fleet()
    slices, h100s = spread_slices(node, tenant, other_tenant)
    training = submit(tenant, gpus=2, gpu_model="H100-80GB")

    result = schedule_pass()
    assert result.moved == 2 and result.preempted == 0
    moved = [reload(j) for j in slices]
    assert [j.stop_requested for j in moved] == ["move", "move"]
    assert (
        moved[0].stop_reason == f"moved to free GPUs for job {training.pk} (defragmentation); queued again once stopped"
    )
    with scopes_disabled():
        rows = list(JobMove.objects.order_by("job_id"))
        assert [(r.job_id, r.for_job_id, sorted(r.freed)) for r in rows] == [
            (slices[0].pk, training.pk, h100s),
            (slices[1].pk, training.pk, h100s),
        ]
        waiting_events = list(JobEvent.objects.filter(job=training).values_list("detail", flat=True))
        assert any(
            d.startswith("defragmentation: 2 slice(s)") and f"job {training.pk} (2 x H100-80GB)" in d
            for d in waiting_events
        )
        for job in slices:
            assert JobEvent.objects.filter(job=job, detail__startswith="moved to free GPUs").count() == 1
    training = reload(training)
    assert training.pending_reason == (
        "waiting for 2 slice(s) moved off 2 GPU(s) on sim-node-1 to stop: freed for it (defragmentation)"
    )
    # The estimate counts the move (the class's 30 s grace), not the slices' 24 h runtime.
    assert training.estimated_start_at - timezone.now() < timedelta(seconds=31)

    # While they stop: nothing more moves, the reason and estimate stay.
    assert schedule_pass().moved == 0
    assert reload(training).pending_reason.startswith("waiting for 2 slice(s) moved off")

    # The first exits: it is queued again and must not take the card it left (claimed for the training job).
    job_exited(node=node, job_id=slices[0].pk, attempt=1, exit_code=-15, at_ms=now_ms())
    first = reload(slices[0])
    assert first.state == JobState.QUEUED and first.stop_requested == ""
    with scopes_disabled():
        details = list(JobEvent.objects.filter(job=first).values_list("detail", flat=True))
    assert details[-1] == "requeued to be placed again (moved to free GPUs: defragmentation)"
    schedule_pass()
    assert held(reload(slices[0])) and held(reload(slices[0]))[0] not in h100s  # re-placed on an L4
    assert reload(training).state == JobState.QUEUED

    job_exited(node=node, job_id=slices[1].pk, attempt=1, exit_code=-15, at_ms=now_ms())
    schedule_pass()
    training = reload(training)
    assert training.state == JobState.SCHEDULED and held(training) == h100s
    second = reload(slices[1])
    assert second.state == JobState.SCHEDULED and held(second)[0] not in h100s


def test_no_move_when_defragmentation_is_off_or_the_slices_were_moved_recently(sched, tenant, other_tenant):
    node = make_run_fleet()
    slices, _ = spread_slices(node, tenant, other_tenant)
    scheduler_settings_update(actor=None, defrag=False)
    training = submit(tenant, gpus=2, gpu_model="H100-80GB")
    assert schedule_pass().moved == 0
    assert reload(training).pending_reason == "waiting for 2 free whole H100-80GB GPU(s) on one node"

    # On again, but the first slice was moved 10 minutes ago (for another job): at most once per 30 minutes.
    scheduler_settings_update(actor=None, defrag=True, defrag_min_interval_s=30 * 60)
    with scopes_disabled():
        JobMove.objects.create(
            tenant=other_tenant,
            job=slices[0],
            for_job=slices[1],
            node="sim-node-1",
            gpu_uuid="GPU-sim-node-1-0",
            freed=[],
            reason="an earlier move",
            at=timezone.now() - timedelta(minutes=10),
            free_at=timezone.now() - timedelta(minutes=10),
        )
    assert schedule_pass().moved == 0
    training = reload(training)
    assert [reload(j).stop_requested for j in slices] == ["", ""]
    # The why-pending and the estimate count the move to come (20 minutes from now), not the 24 h runtime.
    assert "slices may be moved for it from" in training.pending_reason
    expected = timezone.now() + timedelta(minutes=20, seconds=30)
    assert abs(training.estimated_start_at - expected) < timedelta(seconds=5)


def run_on(job, uuid: str):
    """Hold ``job`` running on the GPU ``uuid`` (as a pass and the agent would have)."""
    gpu = Gpu.objects.select_related("node").get(uuid=uuid)
    Allocation.objects.create(tenant_id=job.tenant_id, job=job, gpu=gpu, share_milli=job.gpu_milli)
    with scopes_disabled():
        Job.objects.filter(pk=job.pk).update(
            state=JobState.RUNNING, node=gpu.node, attempt=1, scheduled_at=timezone.now(), started_at=timezone.now()
        )
    return job


def endpoint_with(tenant, name: str, gpus: list[str]) -> list:
    """An endpoint whose ready replicas (1/2 slices, serving class: not preemptible) run on ``gpus``."""
    from endpoints.models import Endpoint, Replica

    with scopes_disabled():
        endpoint = Endpoint.objects.create(tenant=tenant, name=name, command=["serve"], gpu_milli=500)
        jobs = []
        for uuid in gpus:
            job = run_on(submit(tenant, gpus=0.5, priority="serving"), uuid)
            port = 9000 + Replica.objects.count()
            Replica.objects.create(tenant=tenant, endpoint=endpoint, job=job, version=1, port=port, state="ready")
            jobs.append(job)
    return endpoint, jobs


H100_0, H100_1, L4_2, L4_3 = (f"GPU-sim-node-1-{i}" for i in range(4))


def test_replicas_of_endpoints_with_another_serving_are_moved(sched, tenant):
    make_run_fleet()
    chat, (chat_on_h100, _) = endpoint_with(tenant, "chat", [H100_0, L4_2])
    embed, (embed_on_h100, _) = endpoint_with(tenant, "embed", [H100_1, L4_3])
    training = submit(tenant, gpus=2, gpu_model="H100-80GB")
    assert schedule_pass().moved == 2
    assert [reload(j).stop_requested for j in (chat_on_h100, embed_on_h100)] == ["move", "move"]
    with scopes_disabled():
        assert sorted(JobMove.objects.values_list("job_id", "endpoint_id")) == sorted(
            [(chat_on_h100.pk, chat.pk), (embed_on_h100.pk, embed.pk)]
        )
    assert reload(training).pending_reason.startswith("waiting for 2 slice(s) moved off 2 GPU(s)")


def test_single_replicas_stay(sched, tenant):
    make_run_fleet()
    endpoint_with(tenant, "chat", [H100_0])
    endpoint_with(tenant, "embed", [H100_1])
    training = submit(tenant, gpus=2, gpu_model="H100-80GB")
    assert schedule_pass().moved == 0  # each endpoint has one replica: it stays
    assert reload(training).pending_reason == "waiting for 2 free whole H100-80GB GPU(s) on one node"


def test_an_endpoint_moved_recently_is_left_alone(sched, tenant):
    make_run_fleet()
    chat, (chat_on_h100, other) = endpoint_with(tenant, "chat", [H100_0, L4_2])
    endpoint_with(tenant, "embed", [H100_1, L4_3])
    with scopes_disabled():  # another replica of chat was moved five minutes ago
        JobMove.objects.create(
            tenant=tenant,
            job=other,
            for_job=chat_on_h100,
            endpoint_id=chat.pk,
            node="sim-node-1",
            gpu_uuid=H100_1,
            freed=[],
            reason="an earlier move",
            at=timezone.now() - timedelta(minutes=5),
            free_at=timezone.now() - timedelta(minutes=5),
        )
    training = submit(tenant, gpus=2, gpu_model="H100-80GB")
    assert schedule_pass().moved == 0
    assert reload(chat_on_h100).stop_requested == ""
    assert "slices may be moved for it from" in reload(training).pending_reason
