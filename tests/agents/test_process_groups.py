"""Whether a job's process group still has a process running (``agents.agent.jobs.group_running``): real
processes, each in a session of its own as a job's is."""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from agents.agent import jobs


def _session(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(list(argv), start_new_session=True)


def _until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_group_with_a_live_process_runs_and_an_emptied_one_does_not_without_a_host_scan(monkeypatch):
    proc = _session("sleep", "30")
    try:
        assert jobs.group_running(proc.pid)
    finally:
        proc.kill()
        proc.wait()

    def no_scan(*args, **kwargs):
        raise AssertionError("looked through every process on the host for an empty group")

    monkeypatch.setattr(psutil, "process_iter", no_scan)
    assert not jobs.group_running(proc.pid)  # its one process exited and was reaped: the kernel says so


def test_a_process_left_behind_in_the_group_keeps_it_running():
    proc = _session("sh", "-c", "sleep 30 & exit 0")  # the main process ends, its child stays in the group
    proc.wait()
    try:
        assert jobs.group_running(proc.pid)
    finally:
        os.killpg(proc.pid, 9)
    _until(lambda: not jobs.group_running(proc.pid))


def test_a_group_whose_only_process_is_a_zombie_is_not_running():
    proc = _session("true")
    _until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)  # exited, not reaped yet
    try:
        os.killpg(proc.pid, 0)  # the kernel still counts it in the group
        assert not jobs.group_running(proc.pid)
    finally:
        proc.wait()
