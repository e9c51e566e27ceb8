"""gpushare.flights.FreshFlights: callers of the same read at the same time share one run of it, never one
that began before they asked; a failed run hands nothing on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from gpushare.flights import FreshFlights
from tests.factories import wait_for

WAITERS = 6


class Reads:
    """A read that counts its runs and returns the run's number; the first run waits for ``release``, a later
    run ``n`` until ``expect[n]`` callers wait on it (so the test decides who shares what); run ``fail`` raises."""

    def __init__(self, flights, key, expect, fail=None):
        self.flights, self.key, self.expect, self.fail = flights, key, expect, fail
        self.runs = 0
        self.in_air = threading.Event()
        self.release = threading.Event()

    def __call__(self):
        self.runs += 1
        run = self.runs
        if run == 1:
            self.in_air.set()
            assert self.release.wait(10)
        else:
            wait_for(lambda: self.flights.waiting(self.key) == self.expect[run], timeout=10, interval=0.001)
        if run == self.fail:
            raise RuntimeError("the database went away")
        return run


def burst(pool, flights, reads):
    """A caller's read of "page" in the air, ``WAITERS`` callers asking meanwhile, then the read lands: the
    first caller's future and the others'."""
    first = pool.submit(flights.run, "page", reads)
    assert reads.in_air.wait(10)
    waiters = [pool.submit(flights.run, "page", reads) for _ in range(WAITERS)]
    wait_for(lambda: flights.waiting("page") == WAITERS, timeout=10, interval=0.001)
    reads.release.set()
    return first, waiters


def test_callers_that_ask_while_a_read_is_in_the_air_share_the_next_one():
    flights = FreshFlights()
    reads = Reads(flights, "page", expect={2: WAITERS - 1})
    with ThreadPoolExecutor(WAITERS + 1) as pool:
        first, waiters = burst(pool, flights, reads)
        assert first.result(10) == 1
        # The run in the air began before they asked: none of them gets its result, all get the next run's.
        assert [w.result(10) for w in waiters] == [2] * WAITERS
    assert reads.runs == 2
    assert flights.waiting("page") == 0


def test_a_failed_read_raises_for_its_caller_and_its_waiters_read_again():
    flights = FreshFlights()
    # Run 2 (the first the waiters may share) fails: its leader raises, the other waiters share run 3.
    reads = Reads(flights, "page", expect={2: WAITERS - 1, 3: WAITERS - 2}, fail=2)
    with ThreadPoolExecutor(WAITERS + 1) as pool:
        first, waiters = burst(pool, flights, reads)
        assert first.result(10) == 1
        failed = [w for w in waiters if w.exception(10) is not None]
        shared = [w.result(10) for w in waiters if w.exception(10) is None]
    assert len(failed) == 1 and "went away" in str(failed[0].exception())
    assert shared == [3] * (WAITERS - 1)
    assert reads.runs == 3


def test_reads_of_other_keys_and_reads_one_after_another_are_not_shared():
    flights = FreshFlights()
    reads = Reads(flights, "mine", expect={2: 0, 3: 0})
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(flights.run, "mine", reads)
        assert reads.in_air.wait(10)
        # Another key's read runs at once, while "mine" is in the air.
        assert flights.run("theirs", lambda: "theirs") == "theirs"
        reads.release.set()
        assert mine.result(10) == 1
    assert flights.run("mine", reads) == 2  # nothing kept once a flight lands: the next call reads again
    assert flights.run("mine", reads) == 3
