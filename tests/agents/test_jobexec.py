"""The launch helper (agents/agent/jobexec.c) and the drop in Python (sandbox.Drop) give a job the same
start: the same environment, identity, limits, umask, no_new_privs and work dir, and the same failures.

Each case launches a real job through ``jobs.launch`` both ways and reads what the job itself saw. The
helper is built by ``make native`` (``scripts/jobexec_build.py``), which ``make test`` runs first.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.agent import jobexec
from agents.agent.jobs import LaunchSpec, launch
from agents.agent.main import Agent
from agents.agent.sandbox import Drop, IsolationError, workdir_make

JOB_UID = 61_917  # inside no account's range on a CI machine; the job's files are made for it
PROBE = (
    "import json, os, resource; "
    "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l); "
    "print('SEEN=' + json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'uid': os.getresuid(), "
    "'gid': os.getresgid(), 'groups': os.getgroups(), 'nnp': status['NoNewPrivs'].strip(), "
    "'core': resource.getrlimit(resource.RLIMIT_CORE), 'nofile': resource.getrlimit(resource.RLIMIT_NOFILE), "
    "'nproc': resource.getrlimit(resource.RLIMIT_NPROC), 'umask': os.umask(0), "
    "'fds': sorted(int(f) for f in os.listdir('/proc/self/fd'))}))"
)
WAYS = ["jobexec", "python"]
# A job uid cannot enter /root, where this test's own interpreter may live: the system's, when there is one.
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


@pytest.fixture(scope="module")
def helper() -> Path:
    if not jobexec.BUILT.is_file():
        subprocess.run([sys.executable, "scripts/jobexec_build.py"], check=True, cwd=jobexec.BUILT.parents[2])
    assert not jobexec.untrusted_why(jobexec.BUILT), jobexec.untrusted_why(jobexec.BUILT)
    return jobexec.BUILT


def _spec(command: list[str], env: dict | None = None) -> LaunchSpec:
    return LaunchSpec(
        job_id=7,
        attempt=1,
        command=command,
        env=env or {},
        gpu_uuids=[],
        share_milli=1000,
        mode="dedicated",
        max_runtime_s=60,
        grace_s=1,
    )


def _run(way: str, helper: Path, tmp_path: Path, command: list[str], *, env=None, drop=None, agent_env=None):
    """Launch ``command`` the ``way`` given and wait for it: (exit code, its log)."""
    root = tmp_path / way
    root.mkdir(mode=0o711, exist_ok=True)
    os.chmod(root, 0o711)
    drop = drop or Drop()
    owner = (drop.uid, drop.gid) if drop.uid is not None else None
    workdir = workdir_make(root / "work", owner=owner)
    job = launch(
        _spec(command, env),
        workdir=workdir,
        log_path=root / "job.log",
        agent_env=agent_env if agent_env is not None else {"PATH": "/usr/bin:/bin", "AGENT_SECRET": "s3cret"},
        env_allow=("PATH",),
        extra_env={"GPUSHARE_PINNED": "1"},
        log_cap=1 << 20,
        drop=drop,
        jobexec=helper if way == "jobexec" else None,
    )
    if job.proc is not None:
        job.proc.wait(timeout=30)
        job.log_capture.join(timeout=10)
        job.poll()
    return job.exit_code, (root / "job.log").read_text()


def _seen(log: str) -> dict:
    line = next(line for line in log.splitlines() if line.startswith("SEEN="))
    return json.loads(line[len("SEEN=") :])


@pytest.mark.parametrize("way", WAYS)
def test_the_job_sees_exactly_its_environment_and_work_dir(way, helper, tmp_path):
    env = {"SPACES": "a b  c", "EQUALS": "x=y=z", "UNICODE": "é✓", "EMPTY": ""}
    code, log = _run(way, helper, tmp_path, [PYTHON, "-c", PROBE], env=env)
    assert code == 0, log
    seen = _seen(log)
    for key, value in env.items():
        assert seen["env"][key] == value
    assert seen["env"]["GPUSHARE_PINNED"] == "1"
    assert "AGENT_SECRET" not in seen["env"]  # only allow-listed agent variables reach a job
    assert seen["cwd"] == str(tmp_path / way / "work")
    assert seen["fds"] == [0, 1, 2, 3]  # 3: the listing's own; the helper's environment file is closed
    assert seen["nnp"] == "1"
    assert seen["core"] == [0, 0]
    assert seen["umask"] == 0o077


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
@pytest.mark.parametrize("way", WAYS)
def test_the_job_runs_as_its_uid_with_no_groups_and_its_limits(way, helper, tmp_path):
    drop = Drop(uid=JOB_UID, gid=JOB_UID, nproc=321, nofile=1234)
    groups = os.getgroups()
    os.setgroups([4242, 4243])  # the agent's supplementary groups: the job must keep none of them
    try:
        code, log = _run(way, helper, tmp_path, [PYTHON, "-c", PROBE], drop=drop)
    finally:
        os.setgroups(groups)
    assert code == 0, log
    seen = _seen(log)
    assert seen["uid"] == [JOB_UID] * 3
    assert seen["gid"] == [JOB_UID] * 3
    assert seen["groups"] == []
    assert seen["nproc"] == [321, 321]
    assert seen["nofile"] == [1234, 1234]
    assert seen["nnp"] == "1"


@pytest.mark.parametrize("way", WAYS)
def test_a_program_looked_up_in_the_jobs_path_not_the_agents(way, helper, tmp_path):
    tools = tmp_path / f"tools-{way}"
    tools.mkdir()
    os.chmod(tools, 0o755)
    script = tools / "only-here"
    script.write_text("#!/bin/sh\necho FOUND-IN-JOB-PATH\n")
    script.chmod(0o755)
    code, log = _run(way, helper, tmp_path, ["only-here"], env={"PATH": f"/nonexistent:{tools}"})
    assert code == 0, log
    assert "FOUND-IN-JOB-PATH" in log


@pytest.mark.parametrize("way", WAYS)
def test_a_program_that_cannot_start_fails_with_127_and_says_why(way, helper, tmp_path):
    code, log = _run(way, helper, tmp_path, ["no-such-program-anywhere"])
    assert code == 127
    assert "[gpushare: could not start 'no-such-program-anywhere': No such file or directory]" in log


@pytest.mark.parametrize("way", WAYS)
def test_a_setup_step_that_fails_stops_before_the_program(way, helper, tmp_path):
    marker = tmp_path / f"ran-{way}"
    drop = Drop(cgroup_procs=str(tmp_path / "no-such-cgroup" / "cgroup.procs"))
    code, _log = _run(way, helper, tmp_path, ["sh", "-c", f"touch {marker}"], drop=drop)
    assert code in (126, 127)  # the helper's setup failure; Python: the preexec failure, reported as 127
    assert not marker.exists()


def test_the_jobs_environment_never_reaches_the_helpers_command_line(helper):
    fd = jobexec.environment_file({"TOKEN": "do-not-show-me"})
    try:
        argv = jobexec.jobexec_argv(helper, env_fd=fd, drop=Drop(uid=5, gid=6), argv=["run", "x"])
        assert not any("do-not-show-me" in part for part in argv)
        assert argv[-3:] == ["--", "run", "x"]
        os.lseek(fd, 0, os.SEEK_SET)
        assert os.read(fd, 100) == b"TOKEN=do-not-show-me\0"
    finally:
        os.close(fd)


def test_bad_arguments_are_refused_before_anything_runs(helper, tmp_path):
    marker = tmp_path / "ran"
    for argv in (
        [str(helper)],
        [str(helper), "0", "", "-", "-", "0", "0", "77", "--", "touch", str(marker)],  # fd below 3
        [str(helper), "3", "", "x", "1", "0", "0", "77", "--", "touch", str(marker)],  # uid not a number
        [str(helper), "3", "", "-", "-", "0", "0", "99", "--", "touch", str(marker)],  # umask not octal
        [str(helper), "3", "", "-", "-", "0", "0", "77", "++", "touch", str(marker)],  # no "--"
    ):
        result = subprocess.run(argv, capture_output=True, text=True, env={})
        assert result.returncode == 126, argv
        assert result.stdout.startswith("[gpushare: ")
    assert not marker.exists()


def _copy(helper: Path, folder: Path) -> Path:
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    copy = folder / jobexec.NAME
    copy.write_bytes(helper.read_bytes())
    copy.chmod(0o755)
    return copy


def test_a_helper_others_could_replace_is_never_run(helper, tmp_path):
    copy = _copy(helper, tmp_path / "ok")
    assert jobexec.untrusted_why(copy) == ""
    assert jobexec.jobexec_find(str(copy)) == copy
    copy.chmod(0o775)
    assert "writable by group or others" in jobexec.untrusted_why(copy)
    copy.chmod(0o755)
    os.chmod(copy.parent, 0o777)
    assert "writable by group or others" in jobexec.untrusted_why(copy)
    os.chmod(copy.parent, 0o755)
    if os.geteuid() == 0:
        os.chown(copy, 4242, 4242)
        assert "owned by uid 4242" in jobexec.untrusted_why(copy)
        os.chown(copy, 0, 0)
    copy.chmod(0o644)
    assert "not an executable file" in jobexec.untrusted_why(copy)
    with pytest.raises(jobexec.JobexecUntrusted, match="not an executable file"):
        jobexec.jobexec_find(str(copy))
    # The agent refuses to start with it rather than fall back from what the operator asked for.
    with pytest.raises(IsolationError, match="--jobexec"):
        Agent._jobexec_find(str(copy))
    assert jobexec.jobexec_find("off") is None
    assert jobexec.jobexec_find("auto") == helper


_fork_marker: list[Path | None] = [None]  # a hook cannot be removed once registered: it is disarmed instead
_fork_hook: list[bool] = []


def test_a_launch_through_the_helper_costs_less_of_the_agent(helper, tmp_path):
    """Not a timing test: the helper's launch must not fork the agent (no Python runs in the child), which
    a preexec function always does; checked by what the child shares: a vfork'd child borrows the parent's
    memory until its exec, so Python's at-fork hooks never run in it."""
    marker = tmp_path / "forked"
    _fork_marker[0] = marker
    if not _fork_hook:
        _fork_hook.append(True)
        os.register_at_fork(after_in_child=lambda: _fork_marker[0] and _fork_marker[0].touch())
    try:
        _run("jobexec", helper, tmp_path, ["true"])
        assert not marker.exists()
        _run("python", helper, tmp_path, ["true"])
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists()  # the check can fail: the Python drop's fork does run the hook
    finally:
        _fork_marker[0] = None
    assert stat.S_IMODE(os.stat(helper).st_mode) == 0o755
