"""One cgroup v2 per job (``--cgroup-root``): a process that escaped the job's
process group is still stopped, and a run-as job joins its cgroup before it
drops privileges."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psutil
import pytest

from agents.agent.cgroups import JobCgroup, pid_cgroup, unified_mount
from agents.agent.jobs import LaunchSpec, RunningJob
from agents.dispatch import node_send
from tests.agents.conftest import launch_direct, wait_output
from tests.factories import wait_for

pytestmark = pytest.mark.integration

ESCAPE = r"""
import os, signal, sys, time
def say(text):
    os.write(1, (text + '\n').encode())
if os.fork() == 0:
    os.setsid()  # leaves the job's process group (and session): killpg no longer reaches it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    say('ESCAPED=%d' % os.getpid())
    while True:
        time.sleep(0.1)
say('MAIN=%d' % os.getpid())
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def cgroup_dir():
    """A cgroup v2 directory of the test's own (tests stop their agent first, so it is empty here)."""
    mount = unified_mount()
    assert mount is not None, "this host has no cgroup v2 hierarchy"
    path = mount / f"ga-test-{uuid.uuid4().hex[:8]}"
    yield path
    for child in sorted(path.glob("job-*")):  # what an agent did not clean up itself
        try:
            (child / "cgroup.kill").write_text("1")
            wait_for(lambda c=child: not (c / "cgroup.procs").read_text().split(), timeout=10, what="cleanup")
            child.rmdir()
        except FileNotFoundError:
            pass

    def removed():
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # an agent still finishing a job: it removes its job cgroup itself
            return False
        return True

    wait_for(removed, timeout=30, interval=0.5, what=f"{path} to be removed")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _value(output: str, key: str) -> int:
    return int(output.split(f"{key}=")[1].split()[0])


def test_a_process_that_left_the_process_group_is_still_stopped(agent_factory, node, cgroup_dir):
    agent = agent_factory(node, extra=["--cgroup-root", str(cgroup_dir)])
    launch_direct(agent, 9301, [sys.executable, "-c", ESCAPE], grace_s=2)
    output = wait_for(
        lambda: "ESCAPED=" in (out := wait_output(agent, 9301, "MAIN=")) and out, timeout=45, what="both processes"
    )
    main, escaped = _value(output, "MAIN"), _value(output, "ESCAPED")
    in_cgroup = set((cgroup_dir / "job-9301-1" / "cgroup.procs").read_text().split())
    assert {str(main), str(escaped)} <= in_cgroup

    node_send(agent.node, "agent.stop", {"job_id": 9301, "attempt": 1, "reason": "test stop", "grace_s": 2})
    wait_for(lambda: not _alive(escaped) and not _alive(main), timeout=45, what="the escaped process killed too")
    wait_for(lambda: "job 9301 attempt 1 ended" in agent.log(), timeout=45, what="the end reported")
    assert not (cgroup_dir / "job-9301-1").exists()
    agent.stop()


def test_run_as_joins_the_cgroup_then_drops_privileges(agent_factory, node, cgroup_dir):
    agent = agent_factory(node, extra=["--cgroup-root", str(cgroup_dir), "--run-as", "nobody"])
    script = "echo ids=$(/usr/bin/id -u):$(/usr/bin/id -G) cg=$(cat /proc/self/cgroup | grep '^0::'); sleep 30"
    launch_direct(agent, 9302, ["/bin/sh", "-c", script])
    output = wait_output(agent, 9302, "ids=")
    assert "ids=65534:65534 " in output  # the user, and no supplementary group of the agent's
    assert f"/{cgroup_dir.name}/job-9302-1" in output.split("cg=")[1]
    agent.stop()  # the agent stops the job and removes its cgroup
    assert not (cgroup_dir / "job-9302-1").exists()


def test_a_job_cgroup_is_its_whole_subtree(cgroup_dir):
    """What a container engine makes below the job's cgroup is the job's: listed, matched by
    ``/proc/<pid>/cgroup``, killed, and removed with the job's cgroup."""
    cgroup_dir.mkdir()
    job, other = JobCgroup.create(cgroup_dir, "9401-1"), JobCgroup.create(cgroup_dir, "9401-10")
    container = job.path / "docker-abc" / "nested"
    container.mkdir(parents=True)
    proc, stranger = (
        subprocess.Popen(
            ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec sleep 60', str(where)], start_new_session=True
        )
        for where in (container, other.path)
    )
    try:
        wait_for(lambda: proc.pid in job.pids(), timeout=10, what="the process in the job's subtree")
        wait_for(lambda: stranger.pid in other.pids(), timeout=10, what="the other job's process")
        assert job.pids() == {proc.pid} and other.pids() == {stranger.pid}
        where = pid_cgroup(proc.pid)
        assert where == f"/{cgroup_dir.name}/job-9401-1/docker-abc/nested"
        assert job.holds(where) and not other.holds(where)  # job-9401-10 is not below job-9401-1
        # What the GPU driver reports, by host pid, goes to the job whose cgroup holds it.
        running = RunningJob(
            spec=LaunchSpec.from_message({"job_id": 9401, "command": ["x"]}),
            proc=None,
            pgid=-1,
            started_ms=0,
            workdir=cgroup_dir,
            log_path=cgroup_dir,
            cgroup=job,
        )
        on_gpu = {pid: pid_cgroup(pid) for pid in (proc.pid, stranger.pid, os.getpid())}
        assert running.claim(on_gpu) == {proc.pid}
        job.kill()
        assert proc.wait(timeout=10) == -9
        job.remove()
        assert not job.path.exists()
    finally:
        for process in (proc, stranger):
            process.kill()
            process.wait()
        other.remove()
