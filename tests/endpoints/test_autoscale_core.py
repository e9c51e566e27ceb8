"""The pure autoscaling decision."""

from endpoints.autoscale import Load, desired_replicas


def load(**kw) -> Load:
    base = dict(
        inflight=0,
        queued=0,
        peak=0,
        idle_ms=0,
        current=0,
        min_replicas=0,
        max_replicas=4,
        target=2,
        idle_timeout_ms=60_000,
    )
    return Load(**{**base, **kw})


def test_a_request_at_zero_replicas_starts_one():
    assert desired_replicas(load(queued=1, idle_ms=0)).replicas == 1


def test_demand_above_target_scales_up_at_once_within_max():
    assert desired_replicas(load(inflight=5, current=1, peak=5)).replicas == 3
    decision = desired_replicas(load(inflight=40, current=1, peak=40))
    assert decision.replicas == 4
    assert "bounded" in decision.reason


def test_scale_down_waits_for_the_recent_peak_to_pass():
    # A burst of 8 a little while ago keeps 4 replicas warm although 1 request is in flight now.
    assert desired_replicas(load(inflight=1, current=4, peak=8, idle_ms=100)).replicas == 4
    # Once the window's peak is small, fewer replicas suffice.
    assert desired_replicas(load(inflight=1, current=4, peak=2, idle_ms=100)).replicas == 1


def test_idle_for_the_timeout_scales_to_min():
    assert desired_replicas(load(current=3, peak=0, idle_ms=61_000)).replicas == 0
    assert desired_replicas(load(current=3, peak=0, idle_ms=61_000, min_replicas=1)).replicas == 1
    # Not idle long enough: keep what the peak needed.
    assert desired_replicas(load(current=3, peak=6, idle_ms=30_000)).replicas == 3


def test_a_quiet_window_short_of_the_idle_timeout_keeps_one_replica():
    """A peak of 0 in the window (the burst ended) is not a whole idle timeout: one replica stays warm, and
    zero comes only with the idle timeout, for that reason (the CI flake of session 24: "peak of 0")."""
    decision = desired_replicas(load(current=3, peak=0, idle_ms=30_000))
    assert decision.replicas == 1 and "peak of 0" in decision.reason
    decision = desired_replicas(load(current=1, peak=0, idle_ms=61_000))
    assert decision.replicas == 0 and "idle for over" in decision.reason


def test_never_used_endpoint_stays_at_min():
    assert desired_replicas(load(idle_ms=None)).replicas == 0
    assert desired_replicas(load(idle_ms=None, min_replicas=2)).replicas == 2
