"""Stopping a job: SIGTERM to the whole process tree, the grace period, SIGKILL;
max runtime; the log cap."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from agents.dispatch import node_send
from tests.agents.conftest import job_log, launch_direct, wait_output
from tests.factories import wait_for

pytestmark = pytest.mark.integration

# A parent and two children (one in a grandchild generation) that all ignore SIGTERM,
# saying so, and print their pids.
STUBBORN_TREE = r"""
import os, signal, sys, time
def say(text):
    os.write(1, (text + '\n').encode())  # one write: lines of several processes never interleave
def term(signum, frame):
    say('TERM in %d' % os.getpid())
signal.signal(signal.SIGTERM, term)
say('GRACE=' + os.environ['GPUSHARE_GRACE_SECONDS'])
pids = [os.getpid()]
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            pass  # grandchild
        say('PID=%d' % os.getpid())
        while True:
            time.sleep(0.1)
    pids.append(pid)
say('PID=%d' % os.getpid())
while True:
    time.sleep(0.1)
"""


def _pids(output: str) -> set[int]:
    return {int(line.split("=")[1]) for line in output.splitlines() if line.startswith("PID=")}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_terms_the_whole_tree_waits_the_grace_period_then_kills(agent_factory, node):
    agent = agent_factory(node)
    grace = 4
    launch_direct(agent, 8001, [sys.executable, "-c", STUBBORN_TREE], grace_s=grace)
    output = wait_for(
        lambda: len(_pids(out := wait_output(agent, 8001, "GRACE="))) >= 5 and out,
        timeout=45,
        what="the job tree to start",
    )
    assert f"GRACE={grace}" in output
    pids = _pids(output)
    assert all(_alive(p) for p in pids)

    node_send(agent.node, "agent.stop", {"job_id": 8001, "attempt": 1, "reason": "cancelled by test", "grace_s": grace})
    sent = time.monotonic()
    # Every process got SIGTERM (each prints it) and, ignoring it, is still alive inside the grace period.
    wait_for(
        lambda: wait_output(agent, 8001, "TERM in").count("TERM in") >= 5, timeout=30, what="SIGTERM in every process"
    )
    assert time.monotonic() - sent < grace, "the machine was too slow to observe the grace period"
    assert all(_alive(p) for p in pids)
    # Then SIGKILL ends all of them, children and grandchildren included.
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=grace + 30, what="the whole tree to be killed")
    assert time.monotonic() - sent >= grace - 0.5
    wait_for(lambda: "job 8001 attempt 1 ended" in agent.log(), timeout=30, what="the agent to report the end")
    assert "cancelled by test" in agent.log()


def test_max_runtime_stops_the_job(agent_factory, node):
    agent = agent_factory(node)
    launch_direct(
        agent,
        8002,
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
        max_runtime_s=2,
        grace_s=1,
    )
    wait_output(agent, 8002, "up")
    started = time.monotonic()
    wait_for(lambda: "job 8002 attempt 1 ended" in agent.log(), timeout=45, what="max runtime to end the job")
    assert "max runtime of 2 s reached" in agent.log()
    assert time.monotonic() - started < 30


def test_a_flooding_job_is_capped_and_the_log_says_so(agent_factory, node):
    agent = agent_factory(node, extra=["--log-cap-mb", "1"])
    flood = "import sys\nfor _ in range(6 * 1024): sys.stdout.write('x' * 1023 + '\\n')\nprint('done', flush=True)"
    launch_direct(agent, 8003, [sys.executable, "-c", flood])
    wait_for(lambda: "job 8003 attempt 1 ended" in agent.log(), timeout=60, what="the flood to end")
    log_path = job_log(agent, 8003)
    data = log_path.read_bytes()
    assert len(data) < (1 << 20) + 200  # 6 MiB written, 1 MiB kept
    assert b"log capped at 1048576 bytes" in data
    assert b"done" not in data
    assert "log output was capped" in agent.log()


def test_a_newer_attempt_waits_for_the_old_one_to_end(agent_factory, node):
    agent = agent_factory(node)
    hold = [sys.executable, "-c", STUBBORN_TREE]
    launch_direct(agent, 8004, hold, grace_s=3)
    wait_for(lambda: len(_pids(wait_output(agent, 8004, "GRACE="))) >= 5, timeout=45, what="attempt 1 to start")
    old = _pids(wait_output(agent, 8004, "GRACE="))
    launch_direct(
        agent, 8004, [sys.executable, "-c", "import os; os.write(1, b'PID=%d\\n' % os.getpid())"], attempt=2, grace_s=3
    )
    wait_output(agent, 8004, "PID=", attempt=2, timeout=60)
    # Attempt 2 started only once every process of attempt 1 was gone.
    assert not any(_alive(p) for p in old)
    log = agent.log()
    assert log.index("job 8004 attempt 1 ended") < log.index("job 8004 attempt 2 started")
    assert "superseded by a newer attempt" in log


def test_a_launch_sent_again_after_the_attempt_ran_is_ignored(agent_factory, node):
    """The platform re-sends launches that never reported a start; the agent must not run an attempt twice."""
    from tests.agents.conftest import launch_direct, wait_output

    agent = agent_factory(node)
    command = [sys.executable, "-c", "print('ran-once')"]
    launch_direct(agent, 7301, command, gpu_uuids=[])
    wait_output(agent, 7301, "ran-once")
    wait_for(lambda: "job 7301 attempt 1 ended" in agent.log(), what="the attempt to end")
    launch_direct(agent, 7301, command, gpu_uuids=[])
    wait_for(lambda: "job 7301 attempt 1 already ran here; launch ignored" in agent.log(), what="the repeat ignored")
    assert agent.log().count("job 7301 attempt 1 started") == 1
