"""Pass triggers on real Redis: folded while one is queued, never lost, paced after a slow pass."""

from __future__ import annotations

import time

import pytest

from scheduler import passes
from scheduler.tasks import schedule_pass_task

KEYS = (
    passes.PASS_FLAG_KEY,
    passes.PASS_PACE_KEY,
    passes.PASS_LAST_MS_KEY,
    passes.NO_PROGRESS_KEY,
    passes.NO_PROGRESS_HOLD_KEY,
)


@pytest.fixture
def enqueued(monkeypatch):
    """The passes pass_request enqueues, as countdowns in seconds (0 for "now"); Redis keys reset around."""
    client = passes._redis()
    client.delete(*KEYS)
    sent: list[float] = []
    # These tests start passes themselves, sooner than the countdowns they were queued with: no process may
    # rely on a queued pass's start here (test_a_submit_covered_by_a_queued_pass_asks_nothing does).
    monkeypatch.setattr(passes, "_covered_until", 0.0)
    monkeypatch.setattr(passes, "COVER_MIN_MS", 10**9)
    monkeypatch.setattr(schedule_pass_task, "delay", lambda: sent.append(0))
    monkeypatch.setattr(schedule_pass_task, "apply_async", lambda countdown: sent.append(countdown))
    yield sent
    client.delete(*KEYS)


def test_triggers_fold_into_the_queued_pass_until_it_starts(enqueued):
    passes.pass_request()
    passes.pass_request()
    passes.pass_request()
    assert enqueued == [0]
    passes.pass_started()  # the queued pass starts: a trigger now must not be lost
    passes.pass_request()
    assert enqueued == [0, 0]


def test_a_trigger_during_a_long_pass_waits_for_the_pace(enqueued):
    passes.pass_started()
    passes.pass_finished(0.2)  # a slow pass over a long queue
    passes.pass_started()  # the next one starts: a pass asked for now starts 4 x 0.2 s after it
    passes.pass_request()
    passes.pass_request()
    assert len(enqueued) == 1
    assert 0.7 < enqueued[0] <= 0.8


def test_a_trigger_soon_after_a_pass_waits_for_the_rest_of_its_pace(enqueued):
    """A stream of submits between short passes: passes stay at most a quarter of the worker's time."""
    passes.pass_started()
    passes.pass_finished(0.04)  # 40 ms: the next may start 160 ms after this one started
    passes.pass_request()
    assert len(enqueued) == 1 and 0.1 < enqueued[0] <= 0.12


def test_a_trigger_on_a_quiet_cluster_starts_a_pass_at_once(enqueued):
    passes.pass_started()
    passes.pass_finished(0.003)  # an idle cluster's pass: 3 ms, its pace over after 12 ms
    time.sleep(0.02)
    passes.pass_request()
    assert enqueued == [0]


def test_after_a_pass_that_moved_nothing_new_jobs_alone_wait_for_the_next(enqueued):
    """A full (or cordoned) cluster and a stream of submits: the passes they ask for come at most every
    NO_PROGRESS_PACE_MS, not at the pace of a quarter of a worker; a job that ends (room) asks at once."""
    passes.pass_started()
    passes.pass_finished(0.003, progressed=False)
    time.sleep(0.02)  # past this pass's own pace
    passes.pass_request(submitted=True)
    assert len(enqueued) == 1 and 0.2 < enqueued[0] <= passes.NO_PROGRESS_PACE_MS / 1000
    passes.pass_started()
    passes.pass_finished(0.003, progressed=False)
    time.sleep(0.02)
    passes.pass_request()  # not a submit: a job ended, a node came up: at once
    assert enqueued[1] == 0
    passes.pass_started()  # that pass starts: the next submit's pass waits only for the ordinary pace (12 ms)
    passes.pass_request(submitted=True)  # not held back any more
    assert enqueued[2] <= passes.pace_ms(3) / 1000


def test_after_a_pass_that_moved_the_queue_new_jobs_start_a_pass_at_once(enqueued):
    passes.pass_started()
    passes.pass_finished(0.003, progressed=True)
    time.sleep(0.02)
    passes.pass_request(submitted=True)
    assert enqueued == [0]


@pytest.mark.parametrize(
    ("placed", "preempted", "moved", "pending", "progressed"),
    [(0, 0, 0, 5, False), (1, 0, 0, 5, True), (0, 1, 0, 5, True), (0, 0, 1, 5, True), (0, 0, 0, 0, True)],
)
def test_a_pass_progressed_when_the_queue_moved_or_nothing_waited(placed, preempted, moved, pending, progressed):
    result = passes.PassResult(placed=placed, preempted=preempted, moved=moved, pending=pending)
    assert result.progressed is progressed


def test_the_pace():
    assert passes.pace_ms(0) == 0
    assert passes.pace_ms(5) == 20  # an idle cluster's pass: nothing to notice
    assert passes.pace_ms(40) == 160  # a quarter of the worker's time at most
    assert passes.pace_ms(5_000) == passes.PACE_MAX_MS == 1000


def test_a_submit_during_a_pass_after_one_that_moved_nothing_waits_the_whole_hold(enqueued):
    """The hold counts from the start of the pass that runs now, not from the end of the last one: a stream
    of submits into a full cluster gets a pass every NO_PROGRESS_PACE_MS or so, not one right behind each."""
    passes.pass_started()
    passes.pass_finished(0.003, progressed=False)
    time.sleep(0.2)  # most of the hold is gone when the next pass starts...
    passes.pass_started()
    passes.pass_request(submitted=True)  # ...and a submit arrives while it runs
    assert len(enqueued) == 1 and 0.2 < enqueued[0] <= passes.NO_PROGRESS_PACE_MS / 1000
    passes.pass_finished(0.003, progressed=True)  # that pass moved the queue: submits ask at once again
    passes.pass_started()
    passes.pass_request(submitted=True)
    assert enqueued[1] <= passes.pace_ms(3) / 1000


def _futile_pass_then_a_submit(enqueued: list[float]) -> float:
    """A pass that finds no room, past its own pace; then a submit: the countdown its pass gets (s)."""
    passes.pass_started()
    passes.pass_finished(0.003, progressed=False)
    time.sleep(0.02)
    passes.pass_request(submitted=True)
    return enqueued[-1]


def test_each_pass_in_a_row_that_finds_no_room_doubles_the_hold_up_to_a_second(enqueued):
    """A sweep submitted into a full cluster: 250 ms, 500 ms, then 1 s between its futile passes (each
    reads the whole queue), not four a second; room (a job ends) or a pass that moved starts again at 250."""
    waits = [_futile_pass_then_a_submit(enqueued) for _ in range(4)]
    assert len(enqueued) == 4
    assert 0.2 < waits[0] <= 0.25 and 0.45 < waits[1] <= 0.5 and 0.95 < waits[2] <= 1.0 and 0.95 < waits[3] <= 1.0
    passes.pass_started()  # the held pass starts: a submit during it waits the whole (long) hold, too
    passes.pass_request(submitted=True)
    assert 0.95 < enqueued[-1] <= 1.0
    passes.pass_finished(0.003, progressed=False)
    passes.pass_started()  # the held pass starts; a job ends while it runs: the next at the pace, no hold
    passes.pass_request()
    assert len(enqueued) == 6 and enqueued[-1] <= passes.pace_ms(3) / 1000
    passes.pass_finished(0.003, progressed=False)  # the streak was over: this pass's hold is the first again
    passes.pass_started()
    passes.pass_request(submitted=True)
    assert 0.2 < enqueued[-1] <= 0.25
    passes.pass_finished(0.003, progressed=True)  # the queue moved: no hold, and the next streak starts anew
    assert 0.2 < _futile_pass_then_a_submit(enqueued) <= 0.25
    assert 0.45 < _futile_pass_then_a_submit(enqueued) <= 0.5


def test_a_submit_covered_by_a_queued_pass_asks_nothing(enqueued, monkeypatch):
    """A burst of submits into a held queue: the first submit's trigger learns that the queued pass starts
    in ~250 ms; this process's next submits until shortly before then ask Redis nothing (that pass reads
    their jobs). Not a submit (a job's end) always asks. Another process learns the same from the flag."""
    monkeypatch.setattr(passes, "COVER_MIN_MS", 100)  # some slack for a slow machine between the steps
    calls: list[list] = []
    real = passes.script_run
    monkeypatch.setattr(passes, "script_run", lambda *a: calls.append(a[3]) or real(*a))
    passes.pass_started()
    passes.pass_finished(0.003, progressed=False)  # no room: submits' passes are held 250 ms
    time.sleep(0.02)
    passes.pass_request(submitted=True)
    assert len(enqueued) == 1 and 0.2 < enqueued[0] <= 0.25 and len(calls) == 1
    margin_s = passes.COVER_MARGIN_MS / 1000
    assert passes._covered_until - time.monotonic() <= enqueued[0] - margin_s  # ends before that pass may start
    for _ in range(5):
        passes.pass_request(submitted=True)
    assert len(calls) == 1 and len(enqueued) == 1
    passes.pass_request()  # a job ended: asks (clears the hold), folded into the queued pass
    assert len(calls) == 2 and len(enqueued) == 1
    monkeypatch.setattr(passes, "_covered_until", 0.0)  # another process, which knows nothing yet
    passes.pass_request(submitted=True)
    assert len(calls) == 3 and len(enqueued) == 1  # folded, and covered from now on by the flag's start time
    assert 0 < passes._covered_until - time.monotonic() <= enqueued[0] - margin_s
    time.sleep(passes._covered_until - time.monotonic() + 0.01)  # covered no longer: asks again
    passes.pass_request(submitted=True)
    assert len(calls) == 4


def test_a_pass_queued_to_start_at_once_covers_nothing(enqueued, monkeypatch):
    monkeypatch.setattr(passes, "COVER_MIN_MS", 200)
    passes.pass_request(submitted=True)  # a quiet cluster: queued now, no countdown
    passes.pass_request(submitted=True)
    assert enqueued == [0] and passes._covered_until == 0.0
