"""gpushare.ratelimit's GCRA lease in the real Redis: as many as fit, never more, and requests handed back."""

from __future__ import annotations

import secrets

import pytest
import redis
from django.conf import settings

from gpushare.ratelimit import GCRA_FUNCTION

LEASE = (
    GCRA_FUNCTION
    + """
local granted, wait = gcra_lease(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), now_us(), tonumber(ARGV[3]),
                                 tonumber(ARGV[4]))
return {granted, wait}
"""
)
ONE = GCRA_FUNCTION + "return gcra(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), now_us())\n"
SECOND = 1_000_000  # µs: one request a second, so the test's own milliseconds change nothing
BURST = 9 * SECOND  # ten at once


@pytest.fixture
def run():
    """``run(script, *args)``: a script of this module on a key of the test's own (deleted after)."""
    server = redis.Redis.from_url(settings.REDIS_URL)
    key = f"test:lease:{secrets.token_hex(4)}"
    yield lambda script, *args: server.register_script(script)(keys=[key], args=[SECOND, BURST, *args])
    server.delete(key)


def test_a_lease_grants_what_fits_then_the_wait_and_takes_back_what_was_not_used(run):
    assert run(LEASE, 4, 0) == [4, 0]
    assert run(LEASE, 4, 0) == [4, 0]
    assert run(LEASE, 4, 0) == [2, 0]  # two fit of the four asked
    granted, wait = run(LEASE, 1, 0)
    assert granted == 0 and 900 <= wait <= 1000  # the next one in ~1 s
    assert run(LEASE, 3, 2) == [2, 0]  # two handed back: two fit again
    assert run(LEASE, 1, 0)[0] == 0


def test_handing_back_never_raises_an_idle_clients_allowance_past_the_burst(run):
    assert run(LEASE, 1, 0) == [1, 0]
    assert run(LEASE, 20, 50) == [10, 0]  # 50 "back" of 1 used: still ten


def test_a_single_check_is_a_lease_of_one(run):
    assert [run(ONE) for _ in range(10)] == [0] * 10
    assert 900 <= run(ONE) <= 1000
