"""The uid pool: two jobs (even of one tenant) never share a uid, a uid that
anything still runs as is never handed out, and after an agent crash the
orphans left running as pool uids are killed before their uids are reused."""

from __future__ import annotations

import psutil
import pytest

from tests.agents.conftest import job_dir, launch_direct, wait_output
from tests.factories import wait_for
from tests.security.conftest import PY, job_result, run_as, uid_processes

pytestmark = pytest.mark.integration

REPORT = (
    "import json, os, resource, time\n"
    "def lim(r): return resource.getrlimit(r)[0]\n"
    "status = open('/proc/self/status').read()\n"
    "nnp = [l.split()[1] for l in status.splitlines() if l.startswith('NoNewPrivs:')][0]\n"
    "print('RESULT=' + json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(), "
    "'nnp': nnp, 'core': lim(resource.RLIMIT_CORE), 'nproc': lim(resource.RLIMIT_NPROC), "
    "'nofile': lim(resource.RLIMIT_NOFILE), 'umask': os.umask(0)}), flush=True)\n"
    "time.sleep(300)\n"
)

ESCAPE = r"""
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a grandchild in its own session: neither the process group nor the parent knows it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(1, ('ESCAPED=%d\n' % os.getpid()).encode())
        while True:
            time.sleep(0.1)
    os._exit(0)
os.write(1, ('MAIN=%d\n' % os.getuid()).encode())
while True:
    time.sleep(0.1)
"""


def test_same_tenant_jobs_get_their_own_uids_skipping_one_in_use(secure_agent):
    agent = secure_agent(pool_size=3, extra=["--job-nproc", "512"])
    first = int(agent.argv[agent.argv.index("--uid-pool") + 1].split("-")[0])
    squatter = run_as(first, ["/bin/sleep", "300"])  # something already runs as the pool's first uid
    try:
        wait_for(lambda: uid_processes(first), timeout=10, what="the squatter to run")
        for job_id in (9501, 9502):
            launch_direct(agent, job_id, [PY, "-c", REPORT], tenant="acme")
        one, two = (job_result(wait_output(agent, j, "RESULT=")) for j in (9501, 9502))
        assert {one["uid"], two["uid"]} == {first + 1, first + 2}  # never the squatter's uid, never shared
        for job in (one, two):
            assert job["gid"] == job["uid"] and job["groups"] == []
            assert job["nnp"] == "1"  # no_new_privs: no setuid binary gives privileges back
            assert job["core"] == 0 and job["nproc"] == 512
            assert job["nofile"] <= 65536
            assert job["umask"] == 0o077
        # The pool is exhausted: a third job is refused with the reason, not run under a shared uid.
        launch_direct(agent, 9503, [PY, "-c", REPORT], tenant="acme")
        wait_for(lambda: "exhausted" in agent.log(), timeout=30, what="the third job refused")
        assert "job 9503 attempt 1 not started: uid pool" in agent.log()
    finally:
        squatter.kill()
        squatter.wait()


def test_orphans_of_a_crashed_agent_are_killed_before_their_uid_is_reused(secure_agent):
    agent = secure_agent(pool_size=2)
    first, last = (int(x) for x in agent.argv[agent.argv.index("--uid-pool") + 1].split("-"))
    launch_direct(agent, 9511, [PY, "-c", ESCAPE], tenant="acme")
    out = wait_for(lambda: "ESCAPED=" in (o := wait_output(agent, 9511, "MAIN=")) and o, timeout=30, what="the escape")
    uid = int(out.split("MAIN=")[1].split()[0])
    escaped = int(out.split("ESCAPED=")[1].split()[0])
    assert uid in (first, last) and escaped in uid_processes(uid)
    agent.kill()  # a crash: the escaped grandchild is now an orphan still running as a pool uid

    agent.start()  # the same agent, same state, same pool
    wait_for(lambda: agent.log().count(" up: ") >= 2, timeout=30, what="the agent back up")
    wait_for(lambda: not uid_processes(uid), timeout=30, what="the orphan killed at start")
    assert not psutil.pid_exists(escaped) or psutil.Process(escaped).status() == psutil.STATUS_ZOMBIE
    assert f"left running as job uid {uid} by a previous run" in agent.log()
    launch_direct(agent, 9512, [PY, "-c", REPORT], tenant="globex")
    new = job_result(wait_output(agent, 9512, "RESULT="))
    assert new["uid"] in (first, last)
    assert len(uid_processes(new["uid"])) == 1  # the new job alone runs as its uid


def test_a_job_cannot_fork_past_its_process_limit(secure_agent):
    agent = secure_agent(extra=["--job-nproc", "20"])
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('STOPPED_AT=%d %s' % (n, e.__class__.__name__), flush=True)\n"
        "time.sleep(30)\n"
    )
    launch_direct(agent, 9521, [PY, "-c", bomb], tenant="acme")
    out = wait_output(agent, 9521, "STOPPED_AT=")
    assert int(out.split("STOPPED_AT=")[1].split()[0]) < 20


def test_a_kept_work_dir_keeps_its_uid_reserved_until_it_goes(secure_agent):
    agent = secure_agent(pool_size=1, extra=["--keep-workdir-minutes", "0.1"])  # 6 s, for debugging
    launch_direct(agent, 9531, [PY, "-c", "print('done', flush=True)"], tenant="acme")
    wait_for(lambda: "job 9531 attempt 1 ended" in agent.log(), timeout=30, what="the job's end")
    assert job_dir(agent, 9531).exists()  # kept for the operator
    # Its uid still owns files: no other job may have it meanwhile.
    launch_direct(agent, 9532, [PY, "-c", "print('second', flush=True)"], tenant="globex")
    wait_for(lambda: "job 9532 attempt 1 not started: uid pool" in agent.log(), timeout=30, what="the refusal")
    wait_for(lambda: not job_dir(agent, 9531).exists(), timeout=30, what="the kept work dir removed")
    launch_direct(agent, 9533, [PY, "-c", "print('third', flush=True)"], tenant="globex")
    wait_output(agent, 9533, "third")
