"""The what-if proof: on a fixed recorded history, a rule change that favours tenant A shows A's
wait going down, and the replay matches what the real scheduler does on the same history.

The "real scheduler" here is scheduler.services (job_submit, schedule_pass, job_started,
job_exited) on PostgreSQL, driven by a fake clock and by the agent's reports, without
processes: every submission, pass, start and exit happens at an exact instant of the history.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from unittest import mock

from django.urls import reverse
from django_scopes import scopes_disabled

from accounts.models import AuditLog
from agents.models import Node
from console import replay, services, whatif
from console.rules import ClassDraft
from scheduler import services as scheduler_services
from scheduler.models import Job, JobState, PriorityClass
from tests.console.conftest import node_with_gpus
from tests.factories import TenantFactory, member_add

MIN = 60_000
T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC)  # a whole second: ms conversions are exact


@dataclass(frozen=True)
class Submission:
    at_min: int
    tenant: str
    priority: str
    run_min: int


# B trains in 'standard' and keeps the two GPUs busy; A's short jobs in 'preemptible' queue behind.
HISTORY = [
    Submission(0, "bravo", "standard", 30),
    Submission(0, "bravo", "standard", 30),
    Submission(1, "alpha", "preemptible", 15),
    Submission(2, "alpha", "preemptible", 15),
    Submission(5, "bravo", "standard", 20),
    Submission(10, "bravo", "standard", 30),
    Submission(12, "alpha", "preemptible", 10),
    Submission(40, "bravo", "standard", 10),
    Submission(41, "alpha", "preemptible", 5),
    Submission(42, "alpha", "preemptible", 5),
]


def ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def dt(at_ms: int) -> datetime:
    return datetime.fromtimestamp(at_ms / 1000, tz=UTC)


def run_real_scheduler(history: list[Submission], *, start: datetime, tenants: dict) -> list[Job]:
    """Submit ``history`` at its instants through the real services; jobs run exactly their run time.

    The agent is played by the test: a placed job starts at once, exits after its run time, and a job
    asked to stop for preemption exits when its class's grace period ends. Returns the jobs in
    submission order, as recorded.
    """
    clock = [ms(start)]
    users = {slug: member_add(t) for slug, t in tenants.items()}
    FINISH, STOP, ARRIVE = 0, 1, 2  # at one instant: exits first, then arrivals, then a pass
    events = [(ms(start) + s.at_min * MIN, ARRIVE, i, 0) for i, s in enumerate(history)]
    heapq.heapify(events)
    jobs: dict[int, Job] = {}
    seen: set[tuple[int, int, str]] = set()  # (index, attempt, what) already handled
    with mock.patch("django.utils.timezone.now", lambda: dt(clock[0])), scopes_disabled():
        while events:
            now = events[0][0]
            clock[0] = now
            while events and events[0][0] == now:
                _, kind, i, attempt = heapq.heappop(events)
                if kind == ARRIVE:
                    s = history[i]
                    spec = scheduler_services.JobSpec(
                        kind="training", gpu_milli=1000, command=["true"], priority=s.priority, max_runtime_s=3600
                    )
                    jobs[i] = scheduler_services.job_submit(tenant=tenants[s.tenant], user=users[s.tenant], spec=spec)
                    continue
                job = Job.objects.select_related("node").get(pk=jobs[i].pk)
                if job.attempt == attempt and job.state in (JobState.SCHEDULED, JobState.RUNNING):
                    scheduler_services.job_exited(
                        node=job.node,
                        job_id=job.pk,
                        attempt=attempt,
                        exit_code=0 if kind == FINISH else -15,
                        at_ms=now,
                    )
            scheduler_services.schedule_pass()
            for i, job in jobs.items():
                fresh = Job.objects.select_related("node", "priority").get(pk=job.pk)
                if fresh.state == JobState.SCHEDULED and (i, fresh.attempt, "start") not in seen:
                    seen.add((i, fresh.attempt, "start"))
                    scheduler_services.job_started(node=fresh.node, job_id=fresh.pk, attempt=fresh.attempt, at_ms=now)
                    heapq.heappush(events, (now + history[i].run_min * MIN, FINISH, i, fresh.attempt))
                if fresh.stop_requested == "preempt" and (i, fresh.attempt, "stop") not in seen:
                    seen.add((i, fresh.attempt, "stop"))
                    heapq.heappush(events, (now + fresh.priority.grace_period_s * 1000, STOP, i, fresh.attempt))
        return [Job.objects.get(pk=jobs[i].pk) for i in range(len(history))]


def first_waits_min(jobs: list[Job]) -> list[float]:
    """Minutes from submission to first start, from each job's timeline."""
    out = []
    with scopes_disabled():
        for job in jobs:
            first = job.events.filter(to_state=JobState.RUNNING).order_by("at", "id").first()
            out.append((first.at - job.submitted_at).total_seconds() / 60)
    return out


def waits_min(jobs: list[Job]) -> list[float]:
    return [(j.started_at - j.submitted_at).total_seconds() / 60 for j in jobs]


def test_rule_change_favouring_a_cuts_its_wait_and_matches_the_real_scheduler(db, rules, operator):
    node_with_gpus("solo", ("H100-80GB", "H100-80GB"))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    PriorityClass.objects.get(name="standard").may_preempt.clear()  # rules in force: nobody preempts

    # 1. The recorded history, made by the real scheduler under the rules in force.
    recorded = run_real_scheduler(HISTORY, start=T0, tenants=tenants)
    assert all(j.state == JobState.SUCCEEDED for j in recorded)
    recorded_waits = waits_min(recorded)
    assert recorded_waits[2] > 0  # A really waited behind B

    # 2. The operator's draft: A's class above B's.
    current = replay.ruleset_current()
    proposed = type(current)(
        classes=tuple(
            ClassDraft(**{**c.__dict__, "rank": 250}) if c.name == "preemptible" else c for c in current.classes
        ),
        weights=current.weights,
        half_life_s=current.half_life_s,
    )
    window_end = T0 + timedelta(hours=2)
    comparison = replay.preview(proposed=proposed, hours=2, end=window_end)
    rows = {(r.group, r.name): r for r in comparison.rows}
    alpha, bravo = rows[("tenant", "alpha")], rows[("tenant", "bravo")]
    assert comparison.jobs == len(HISTORY) and comparison.unplaceable == 0
    assert alpha.after.mean_wait_s < alpha.before.mean_wait_s
    assert bravo.after.mean_wait_s > bravo.before.mean_wait_s
    assert alpha.after.started == alpha.after.jobs == 5

    # The replay under the rules in force reproduces the recorded history, job by job.
    by_id = comparison.before.outcomes
    assert [by_id[j.pk].wait_ms / MIN for j in recorded] == recorded_waits

    # 3. Saving is a separate, audited step.
    services.rules_apply(current=current, proposed=proposed, actor=operator)
    assert PriorityClass.objects.get(name="preemptible").rank == 250
    assert AuditLog.objects.filter(action="priority_class.update", target="preemptible").count() == 1

    # 4. The real scheduler, on the same submissions under the new rules, does what the preview said.
    later = run_real_scheduler(HISTORY, start=T0 + timedelta(days=1), tenants=tenants)
    predicted = [comparison.after.outcomes[j.pk].wait_ms / MIN for j in recorded]
    assert waits_min(later) == predicted
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    alpha_real = mean([w for w, s in zip(waits_min(later), HISTORY, strict=True) if s.tenant == "alpha"])
    assert alpha_real * 60 == alpha.after.mean_wait_s


def test_the_preview_page_shows_the_side_by_side_table(staff_client, rules):
    node = node_with_gpus("solo", ("H100-80GB",))
    assert node.state == Node.State.UP
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    PriorityClass.objects.get(name="standard").may_preempt.clear()
    from django.utils import timezone

    run_real_scheduler(HISTORY[:4], start=timezone.now() - timedelta(hours=3), tenants=tenants)
    from tests.console.test_rules import form_data

    response = staff_client.post(
        reverse("console:rules"), {**form_data(**{"preemptible-rank": 250}), "hours": "6", "_preview": "1"}
    )
    html = response.content.decode()
    assert response.context["problems"] == []
    assert 'id="preview-table"' in html and 'data-name="alpha"' in html and 'data-name="bravo"' in html
    row = next(r for r in response.context["comparison"].rows if r.name == "alpha")
    assert row.after.mean_wait_s < row.before.mean_wait_s
    assert "better" in html


def test_whatif_history_reads_runtime_or_max_runtime(db, rules):
    node_with_gpus("solo", ("H100-80GB",))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    run_real_scheduler(HISTORY[:2], start=T0, tenants=tenants)
    history = replay.history_between(start=T0, end=T0 + timedelta(hours=1))
    assert [h.run_ms for h in history] == [30 * MIN, 30 * MIN]
    with scopes_disabled():
        Job.objects.filter(pk=history[1].job_id).update(finished_at=None, started_at=None, state=JobState.QUEUED)
    history = replay.history_between(start=T0, end=T0 + timedelta(hours=1))
    assert history[1].run_ms == 3600 * 1000 and history[1].tenant == "bravo" and not history[1].shared
    assert isinstance(
        whatif.simulate(history=history, nodes=replay.fleet_now(), rules=replay.whatif_rules(replay.ruleset_current())),
        whatif.Replay,
    )


# B runs long jobs in 'preemptible'; A's 'standard' jobs may preempt them (seeded rules: min runtime 60 s,
# grace 30 s); a preempted job goes back to the queue and runs again in full.
PREEMPTION_HISTORY = [
    Submission(0, "bravo", "preemptible", 60),
    Submission(0, "bravo", "preemptible", 60),
    Submission(5, "alpha", "standard", 10),
    Submission(20, "alpha", "standard", 5),
    Submission(21, "alpha", "standard", 5),
]


def test_preemptions_in_the_replay_match_the_real_scheduler(db, rules, operator):
    node_with_gpus("solo", ("H100-80GB", "H100-80GB"))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    recorded = run_real_scheduler(PREEMPTION_HISTORY, start=T0, tenants=tenants)
    assert all(j.state == JobState.SUCCEEDED for j in recorded)
    real_preemptions = [j.preemption_count for j in recorded]
    assert sum(real_preemptions) >= 2  # the real scheduler did preempt bravo

    current = replay.ruleset_current()
    no_preemption = type(current)(
        classes=tuple(
            ClassDraft(**{**c.__dict__, "may_preempt": frozenset()}) if c.name == "standard" else c
            for c in current.classes
        ),
        weights=current.weights,
        half_life_s=current.half_life_s,
    )
    comparison = replay.preview(proposed=no_preemption, hours=2, end=T0 + timedelta(hours=2))
    before = comparison.before.outcomes
    assert [before[j.pk].preemptions for j in recorded] == real_preemptions
    assert [before[j.pk].wait_ms / MIN for j in recorded] == first_waits_min(recorded)
    rows = {(r.group, r.name): r for r in comparison.rows}
    assert rows[("tenant", "bravo")].after.preemptions == 0
    assert rows[("tenant", "bravo")].before.preemptions == sum(real_preemptions)
    assert rows[("tenant", "alpha")].after.mean_wait_s > rows[("tenant", "alpha")].before.mean_wait_s
    # Preempted work is redone: bravo held more GPU-hours with preemption than without.
    assert rows[("tenant", "bravo")].before.gpu_hours > rows[("tenant", "bravo")].after.gpu_hours

    services.rules_apply(current=current, proposed=no_preemption, actor=operator)
    later = run_real_scheduler(PREEMPTION_HISTORY, start=T0 + timedelta(days=1), tenants=tenants)
    assert [j.preemption_count for j in later] == [0] * len(PREEMPTION_HISTORY)
    assert first_waits_min(later) == [comparison.after.outcomes[j.pk].wait_ms / MIN for j in recorded]


def test_a_window_too_large_to_replay_is_refused_with_the_limit(staff_client, rules, monkeypatch):
    from django.utils import timezone

    from tests.console.test_rules import form_data

    node_with_gpus("solo", ("H100-80GB",))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    run_real_scheduler(HISTORY[:3], start=timezone.now() - timedelta(hours=2), tenants=tenants)
    monkeypatch.setattr(replay, "MAX_REPLAY_JOBS", 2)
    response = staff_client.post(reverse("console:rules"), {**form_data(), "hours": "6", "_preview": "1"})
    assert response.context["comparison"] is None
    assert response.context["problems"] == [
        "the window holds 3 submissions and a preview replays at most 2: choose a shorter window"
    ]


def test_the_replay_applies_tenant_caps_as_they_are_now(db, rules, operator):
    from accounts.services import quota_set

    node_with_gpus("solo", ("H100-80GB", "H100-80GB"))
    tenants = {"alpha": TenantFactory(slug="alpha"), "bravo": TenantFactory(slug="bravo")}
    PriorityClass.objects.get(name="standard").may_preempt.clear()
    burst = [Submission(0, "alpha", "standard", 30), Submission(0, "alpha", "standard", 30)]
    run_real_scheduler(burst, start=T0, tenants=tenants)  # recorded with no cap: both ran at once
    current = replay.ruleset_current()
    free = replay.preview(proposed=current, hours=1, end=T0 + timedelta(hours=1))
    assert sorted(o.wait_ms for o in free.after.outcomes.values()) == [0, 0]

    quota_set(tenant=tenants["alpha"], actor=operator, max_dedicated_gpus=1)
    assert replay.limits_now()["alpha"].dedicated_gpus == 1
    capped = replay.preview(proposed=current, hours=1, end=T0 + timedelta(hours=1))
    assert sorted(o.wait_ms for o in capped.after.outcomes.values()) == [0, 30 * MIN]
