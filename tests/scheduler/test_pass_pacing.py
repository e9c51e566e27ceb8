"""Pass triggers on real Redis: folded while one is queued, never lost, paced after a slow pass."""

from __future__ import annotations

import pytest

from scheduler import passes
from scheduler.tasks import schedule_pass_task

KEYS = (passes.PASS_FLAG_KEY, passes.PASS_PACE_KEY, passes.PASS_LAST_MS_KEY)


@pytest.fixture
def enqueued(monkeypatch):
    """The passes pass_request enqueues, as countdowns in seconds (0 for "now"); Redis keys reset around."""
    client = passes._redis()
    client.delete(*KEYS)
    sent: list[float] = []
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


def test_a_trigger_during_a_long_pass_waits_for_its_end_and_a_rest(enqueued):
    passes.pass_started()
    passes.pass_finished(0.4)  # a slow pass over a long queue
    passes.pass_started()  # the next one starts: a pass asked for now starts 0.4 + 0.35 s after it
    passes.pass_request()
    passes.pass_request()
    assert len(enqueued) == 1
    assert 0.55 < enqueued[0] <= 0.75


def test_a_trigger_between_passes_starts_one_at_once(enqueued):
    passes.pass_started()
    passes.pass_finished(0.4)
    passes.pass_request()  # a lone submit after the pass ended
    assert enqueued == [0]


def test_a_short_pass_is_followed_without_a_rest(enqueued):
    passes.pass_finished(0.02)
    passes.pass_started()
    passes.pass_request()
    assert len(enqueued) == 1 and enqueued[0] <= 0.02


def test_the_pace():
    assert passes.pace_ms(0) == 0
    assert passes.pace_ms(30) == 30  # short: the next right after it
    assert passes.pace_ms(250) == 450  # long: a rest of 200 ms after it
    assert passes.pace_ms(5_000) == passes.PACE_MAX_MS == 1000
