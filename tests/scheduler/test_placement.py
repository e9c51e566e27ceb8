"""The pure core, case by case: placement, reasons, limits, fair share, backfill, preemption."""

from __future__ import annotations

from scheduler.placement import Limits, Policy, plan
from tests.scheduler.core_helpers import L4, ded, fleet, node, running, shr

PREEMPT = {"serving": frozenset({"preemptible"}), "standard": frozenset({"preemptible"})}


def where(result) -> dict[int, tuple[str, tuple[str, ...]]]:
    return {p.job_id: (p.node, p.gpu_uuids) for p in result.placements}


def test_gang_goes_to_the_node_with_fewest_free_gpus_that_fits():
    nodes = fleet("n1", "n2", "n3")
    busy = [running(90, "n2", [0, 1, 2, 3, 4]), running(91, "n3", [0, 1, 2, 3, 4, 5])]
    result = plan(nodes, [ded(1, 3)], running=busy)
    node_name, gpus = where(result)[1]
    assert node_name == "n2" and len(gpus) == 3  # n3 has 2 free (too few), n1 has 8 (worse fit)
    assert set(gpus) == {"n2-g5", "n2-g6", "n2-g7"}


def test_gang_is_all_or_nothing_on_one_node():
    nodes = fleet(("n1", 4), ("n2", 4))
    busy = [running(90, "n1", [0, 1]), running(91, "n2", [0, 1])]
    result = plan(nodes, [ded(1, 4)], running=busy)
    assert result.placements == []
    assert result.pending[1] == "waiting for 4 free whole GPU(s) on one node"


def test_four_quarter_slices_share_one_gpu_before_a_second_is_opened():
    nodes = fleet("n1")
    result = plan(nodes, [shr(i, 250) for i in range(1, 6)])
    gpus = [where(result)[i][1][0] for i in range(1, 6)]
    assert len(set(gpus[:4])) == 1
    assert gpus[4] != gpus[0]


def test_slices_best_fit_onto_the_fullest_shared_gpu():
    nodes = fleet("n1")
    busy = [running(90, "n1", [0], share=500), running(91, "n1", [1], share=750)]
    result = plan(nodes, [shr(1, 250)], running=busy)
    assert where(result)[1][1] == ("n1-g1",)


def test_an_idle_gpu_is_opened_on_a_partly_used_node_keeping_empty_nodes_whole():
    nodes = fleet("empty", "used")
    busy = [running(90, "used", [0, 1, 2])]
    result = plan(nodes, [shr(1, 500), ded(2, 8)], running=busy)
    assert where(result)[1][0] == "used"
    assert where(result)[2][0] == "empty"


def test_dedicated_never_lands_on_a_gpu_holding_a_slice():
    nodes = fleet(("n1", 2))
    busy = [running(90, "n1", [0], share=125)]
    result = plan(nodes, [ded(1, 2)], running=busy)
    assert result.placements == []
    result = plan(fleet(("n1", 2)), [ded(1, 1)], running=busy)
    assert where(result)[1][1] == ("n1-g1",)


def test_model_and_memory_constraints_and_their_reasons():
    nodes = [node("h", 2), node("l", 2, L4)]
    result = plan(
        nodes,
        [
            ded(1, 1, gpu_model="L4-24GB"),
            shr(2, 500, gpu_memory_mb=20000, gpu_model="L4-24GB"),
            ded(3, 1, gpu_model="A100"),
            ded(4, 4, gpu_model="H100-80GB"),
            shr(5, 125, gpu_memory_mb=90000),
        ],
    )
    assert where(result)[1][0] == "l" and where(result)[2][0] == "l"
    assert where(result)[1][1] != where(result)[2][1]  # 20 GB of a 24 GB card leaves no room to share it
    assert result.pending[3] == "no schedulable A100 GPU in the fleet"
    assert result.pending[4] == "no node has 4 H100-80GB GPUs for dedicated use (at most 2 on one node)"
    assert result.pending[5] == "no schedulable GPU with 90000 MiB in the fleet"


def test_reservations_keep_gpus_for_their_use():
    nodes = [node("d", 2, reservation="dedicated_only"), node("s", 2, reservation="shared_only")]
    result = plan(nodes, [shr(1, 250), ded(2, 2), ded(3, 1)])
    assert where(result)[1][0] == "s"
    assert where(result)[2][0] == "d"
    assert result.pending[3] == "waiting for 1 free whole GPU(s) on one node"


def test_unschedulable_nodes_and_unhealthy_gpus_are_skipped():
    nodes = [node("down", 8, schedulable=False), node("up", 2)]
    nodes[1].gpus[0].healthy = False
    result = plan(nodes, [ded(1, 1), ded(2, 1)])
    assert where(result)[1] == ("up", ("up-g1",))
    assert 2 in result.pending


def test_tenant_limits_hold_jobs_with_a_reason_naming_the_limit():
    policy = Policy(limits={"a": Limits(dedicated_gpus=3, shared_milli=500)})
    busy = [running(90, "n1", [0], tenant="a", rank=200, priority="standard", preemptible=False)]
    result = plan(
        fleet("n1", "n2"),
        [ded(1, 2), ded(2, 1), shr(3, 500), shr(4, 125), ded(5, 1, tenant="b")],
        running=busy,
        policy=policy,
    )
    assert set(where(result)) == {1, 3, 5}
    assert result.pending[2] == "tenant limit: at most 3 dedicated GPUs at once (3 in use)"
    assert result.pending[4] == "tenant limit: at most 0.5 GPU in shared slices at once (0.5 in use)"


def test_higher_class_goes_first():
    result = plan(fleet(("n1", 1)), [ded(1, 1, rank=100, at=1), ded(2, 1, rank=200, at=2)])
    assert list(where(result)) == [2]
    assert result.positions == {2: 1, 1: 2}


def test_fair_share_interleaves_tenants_by_weight_within_a_pass():
    policy = Policy(weights={"a": 1, "b": 3})
    queue = [ded(i, 1, tenant="a", at=i) for i in range(1, 41)] + [
        ded(100 + i, 1, tenant="b", at=50 + i) for i in range(40)
    ]
    result = plan(fleet("n1", "n2"), queue, policy=policy)
    tenants = ["a" if p.job_id < 100 else "b" for p in result.placements]
    assert tenants.count("a") == 4 and tenants.count("b") == 12


def test_fair_share_puts_the_tenant_below_its_share_first():
    policy = Policy(usage={"a": 5e12, "b": 0}, weights={"a": 1, "b": 1})
    result = plan(fleet(("n1", 1)), [ded(1, 1, tenant="a", at=1), ded(2, 1, tenant="b", at=2)], policy=policy)
    assert list(where(result)) == [2]


def test_backfill_starts_a_short_job_that_ends_before_the_head_can_start():
    nodes = fleet(("n1", 4))
    busy = [running(90, "n1", [0, 1], end=60_000, tenant="z", rank=200, priority="standard", preemptible=False)]
    policy = Policy(now_ms=0)
    queue = [ded(1, 4, at=1), ded(2, 1, at=2, max_runtime_ms=30_000), ded(3, 1, at=3, max_runtime_ms=600_000)]
    result = plan(nodes, queue, running=busy, policy=policy)
    assert list(where(result)) == [2]
    assert result.estimated_start_ms[1] == 60_000
    assert result.pending[3] == "would delay job 1, ahead in the queue, which has the free GPUs reserved (backfill)"
    assert result.estimated_start_ms[3] >= 60_000


def test_without_backfill_nothing_starts_behind_a_blocked_head():
    nodes = fleet(("n1", 4))
    busy = [running(90, "n1", [0, 1], end=60_000, rank=200, priority="standard", preemptible=False)]
    queue = [ded(1, 4, at=1), ded(2, 1, at=2, max_runtime_ms=30_000)]
    result = plan(nodes, queue, running=busy, policy=Policy(backfill=False))
    assert result.placements == []
    assert result.pending[2] == "behind job 1, first in line (backfill is off)"


def test_preemption_picks_the_cheapest_victims_that_make_room():
    nodes = fleet(("n1", 2), ("n2", 2))
    busy = [
        running(90, "n1", [0, 1], started=0),  # 2 GPUs, long run: expensive
        running(91, "n2", [0], started=50_000),
        running(92, "n2", [1], started=60_000),
    ]
    policy = Policy(now_ms=100_000, may_preempt=PREEMPT)
    result = plan(nodes, [ded(1, 2)], running=busy, policy=policy)
    assert {p.victim_id for p in result.preemptions} == {91, 92}
    assert result.pending[1] == "preempting 2 lower-priority job(s) to make room"


def test_preemption_respects_min_runtime_and_class_rules():
    nodes = fleet(("n1", 1))
    young = [running(90, "n1", [0], started=90_000, min_runtime_ms=60_000)]
    policy = Policy(now_ms=100_000, may_preempt=PREEMPT)
    assert plan(fleet(("n1", 1)), [ded(1, 1)], running=young, policy=policy).preemptions == []
    same_class = [running(90, "n1", [0], priority="standard", rank=200)]
    assert plan(nodes, [ded(1, 1)], running=same_class, policy=policy).preemptions == []


def test_no_preemption_when_the_victims_would_not_make_room():
    # The high job needs 4 GPUs on one node; the node has only 3, so stopping the
    # preemptible job there would be pointless.
    nodes = fleet(("n1", 3))
    busy = [running(90, "n1", [0])]
    result = plan(nodes, [ded(1, 4)], running=busy, policy=Policy(now_ms=10**6, may_preempt=PREEMPT))
    assert result.preemptions == []
    # 2 GPUs free, 1 held by a job that may not be preempted: still no room for 3.
    nodes = fleet(("n1", 3))
    busy = [running(90, "n1", [0], priority="standard", rank=200, preemptible=False)]
    nodes2 = fleet(("n1", 3))
    busy2 = busy + [running(91, "n1", [1])]
    assert plan(nodes, [ded(1, 3)], running=busy, policy=Policy(may_preempt=PREEMPT)).preemptions == []
    assert plan(nodes2, [ded(1, 3)], running=busy2, policy=Policy(now_ms=10**6, may_preempt=PREEMPT)).preemptions == []


def test_a_job_waiting_for_stopping_victims_preempts_no_more():
    nodes = fleet(("n1", 2))
    busy = [running(90, "n1", [0], stopping=True), running(91, "n1", [1])]
    policy = Policy(now_ms=10**6, may_preempt=PREEMPT)
    result = plan(nodes, [ded(1, 1)], running=busy, policy=policy)
    assert result.preemptions == []
    assert result.pending[1] == "waiting for preempted lower-priority jobs to stop"


def test_one_victim_serves_one_requester():
    nodes = fleet(("n1", 1))
    busy = [running(90, "n1", [0])]
    policy = Policy(now_ms=10**6, may_preempt=PREEMPT)
    result = plan(nodes, [ded(1, 1, at=1), ded(2, 1, at=2)], running=busy, policy=policy)
    assert [(p.victim_id, p.for_job_id) for p in result.preemptions] == [(90, 1)]
    assert result.pending[2] == "waiting for 1 free whole GPU(s) on one node"


def test_slice_preemption_frees_room_on_one_gpu():
    nodes = fleet(("n1", 1))
    busy = [running(90, "n1", [0], share=500), running(91, "n1", [0], share=500, started=5)]
    result = plan(nodes, [shr(1, 250)], running=busy, policy=Policy(now_ms=10**6, may_preempt=PREEMPT))
    assert [p.victim_id for p in result.preemptions] == [91]  # ran less: cheaper


def test_host_cpu_is_respected_and_gpus_are_not_stranded_without_cpu():
    tight, roomy = node("tight", 2), node("roomy", 2)
    tight.cpu_milli, roomy.cpu_milli = 8000, 64000
    tight.memory_mib = roomy.memory_mib = 10**6
    # On "tight", a 6-core job would leave 1 idle GPU with 2 cores: stranded for jobs like it.
    result = plan([tight, roomy], [ded(1, 1, cpu_milli=6000), ded(2, 1, cpu_milli=40000)])
    assert where(result)[1][0] == "roomy" and where(result)[2][0] == "roomy"
    result = plan([node("small", 1)], [ded(3, 1, cpu_milli=1)])
    assert 3 in where(result)  # host resources not tracked: no limit
    small = node("small", 1)
    small.cpu_milli = 1000
    reason = plan([small], [ded(4, 1, cpu_milli=2000)]).pending[4]
    assert reason == "no node has 1 GPUs for dedicated use (at most 0 on one node)"
