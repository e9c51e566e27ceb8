"""The what-if simulation on its own: plain data in, plain data out (no database)."""

from __future__ import annotations

from console import whatif
from scheduler import placement

H = whatif.HOUR_MS
M = 60_000


def fleet(gpus: int = 2, model: str = "H100-80GB") -> list[placement.NodeSlot]:
    node = placement.NodeSlot(name="n1")
    node.gpus = [placement.GpuSlot(uuid=f"GPU-{i}", node="n1", model=model, memory_mb=81920) for i in range(gpus)]
    return [node]


def rules(**ranks) -> whatif.Rules:
    return whatif.Rules(classes={name: whatif.ClassRule(name, rank) for name, rank in ranks.items()})


def job(job_id, tenant, cls, at_min, run_min, *, count=1, share=None, model=""):
    return whatif.HistoryJob(
        job_id=job_id,
        tenant=tenant,
        priority=cls,
        submitted_ms=at_min * M,
        run_ms=run_min * M,
        shared=share is not None,
        count=count,
        share_milli=share or placement.WHOLE,
        gpu_model=model,
    )


def test_jobs_wait_for_capacity_and_run_their_recorded_duration():
    history = [job(1, "a", "std", 0, 60), job(2, "a", "std", 0, 60), job(3, "b", "std", 10, 30)]
    replay = whatif.simulate(history=history, nodes=fleet(2), rules=rules(std=100))
    assert replay.outcomes[1].start_ms == 0 and replay.outcomes[2].start_ms == 0
    assert replay.outcomes[3].start_ms == 60 * M  # waits for the first GPU to free
    assert replay.outcomes[3].end_ms == 90 * M
    assert replay.per_tenant["b"].mean_wait_s == 50 * 60
    assert replay.per_tenant["a"].gpu_hours == 2.0


def test_slices_share_one_gpu_and_utilisation_counts_fractions():
    history = [job(i, "a", "std", 0, 60, share=250) for i in range(1, 5)]
    replay = whatif.simulate(history=history, nodes=fleet(1), rules=rules(std=100), window_end_ms=60 * M)
    assert all(o.start_ms == 0 for o in replay.outcomes.values())
    assert replay.utilisation == 1.0
    assert replay.per_class["std"].gpu_hours == 1.0


def test_raising_a_class_rank_cuts_its_tenants_wait():
    # b's long jobs arrive first and fill the fleet; a submits in 'batch' while b keeps queueing.
    history = []
    n = 0
    for minute in range(0, 240, 10):
        n += 1
        history.append(job(n, "b", "std", minute, 30))
        n += 1
        history.append(job(n, "a", "batch", minute, 30))
    current, proposed = rules(std=200, batch=100), rules(std=200, batch=300)
    result = whatif.compare(history=history, nodes=fleet(1), current=current, proposed=proposed)
    rows = {(r.group, r.name): r for r in result.rows}
    assert rows[("tenant", "a")].after.mean_wait_s < rows[("tenant", "a")].before.mean_wait_s
    assert rows[("tenant", "b")].after.mean_wait_s > rows[("tenant", "b")].before.mean_wait_s
    # The fleet does the same total work either way.
    total = lambda replay: sum(s.gpu_hours for s in replay.per_tenant.values())  # noqa: E731
    assert abs(total(result.before) - total(result.after)) < 1e-9


def test_a_job_no_gpu_of_the_fleet_can_take_is_reported_not_simulated_forever():
    history = [job(1, "a", "std", 0, 10, model="B200"), job(2, "a", "std", 0, 10, count=4)]
    replay = whatif.simulate(history=history, nodes=fleet(2), rules=rules(std=1))
    assert "B200" in replay.outcomes[1].unplaceable
    assert replay.outcomes[2].unplaceable
    assert replay.per_tenant["a"].started == 0


def test_p95_is_nearest_rank():
    assert whatif.p95([float(i) for i in range(1, 101)]) == 95.0
    assert whatif.p95([3.0]) == 3.0
    assert whatif.p95([]) is None


def test_a_heavier_fair_share_weight_gets_its_tenant_more_of_a_contended_fleet():
    # Two tenants flood one class on one GPU; with equal weights they alternate, with a:3 b:1 a goes first more.
    history, n = [], 0
    for _ in range(12):
        for tenant in ("a", "b"):
            n += 1
            history.append(job(n, tenant, "std", 0, 10))
    equal = rules(std=100)
    favour_a = whatif.Rules(classes=equal.classes, tenant_weights={"a": 3.0, "b": 1.0}, half_life_ms=H)
    result = whatif.compare(history=history, nodes=fleet(1), current=equal, proposed=favour_a)
    rows = {(r.group, r.name): r for r in result.rows}
    assert rows[("tenant", "a")].after.mean_wait_s < rows[("tenant", "a")].before.mean_wait_s
    assert rows[("tenant", "b")].after.mean_wait_s > rows[("tenant", "b")].before.mean_wait_s

    # In the first half of the replay, equal weights share the GPU; a 3:1 weight gives a clearly more.
    def a_starts_in_first_half(replay) -> int:
        first_half = sorted(replay.outcomes.values(), key=lambda o: o.start_ms)[:12]
        return sum(o.tenant == "a" for o in first_half)

    assert a_starts_in_first_half(result.before) in (5, 6, 7)
    assert a_starts_in_first_half(result.after) >= 8
    assert result.after.per_tenant["b"].started == 12  # b is slowed down, never starved


def test_preemption_is_counted_and_the_victim_reruns_in_full():
    classes = {
        "low": whatif.ClassRule("low", 100, preemptible=True, min_runtime_ms=M, grace_ms=30_000),
        "high": whatif.ClassRule("high", 200, may_preempt=frozenset({"low"})),
    }
    history = [job(1, "b", "low", 0, 60), job(2, "a", "high", 5, 10)]
    replay = whatif.simulate(history=history, nodes=fleet(1), rules=whatif.Rules(classes=classes))
    victim, urgent = replay.outcomes[1], replay.outcomes[2]
    assert victim.preemptions == 1 and replay.per_tenant["b"].preemptions == 1
    assert urgent.start_ms == 5 * M + 30_000  # after the victim's grace period
    assert victim.end_ms == urgent.end_ms + 60 * M  # reran all 60 minutes after the urgent job
    # 5.5 minutes thrown away, then 60 minutes again.
    assert victim.held_gpu_ms == 5 * M + 30_000 + 60 * M
    no_preempt = whatif.Rules(classes={**classes, "high": whatif.ClassRule("high", 200)})
    calm = whatif.simulate(history=history, nodes=fleet(1), rules=no_preempt)
    assert calm.outcomes[1].preemptions == 0 and calm.outcomes[2].start_ms == 60 * M
