"""Tenant B's job attacks tenant A's job on the same node: its work dir, temp
files, checkpoint and log, its process environment, and the node token
anywhere B can read. Two tenants, real jobs through the API, one real
multi-tenant agent."""

from __future__ import annotations

import json
import os
import stat

import pytest
from django_scopes import scopes_disabled

from scheduler.models import Job, JobState
from tests.agents.conftest import job_dir, job_log, job_output, wait_output
from tests.factories import TenantFactory, wait_for
from tests.security.conftest import PY, job_result, pool_uids, wait_gone

pytestmark = pytest.mark.integration

VICTIM = r"""
import json, os, time
secret = os.environ["SECRET_A"]
home, tmp = os.environ["HOME"], os.environ["TMPDIR"]
with open(os.path.join(home, "checkpoint.pt"), "w") as f:
    f.write(secret)
with open(os.path.join(tmp, "scratch"), "w") as f:
    f.write(secret)
print("A-LOG " + secret, flush=True)
print("READY=" + json.dumps({"home": home, "tmp": tmp, "pid": os.getpid(), "uid": os.getuid()}), flush=True)
while not os.path.exists(os.path.join(home, "go")):
    time.sleep(0.1)
"""

ATTACKER = r"""
import json, os, time
target = json.loads(os.environ["TARGET"])
home = os.environ["HOME"]
result = {"uid": os.getuid(), "groups": os.getgroups()}

def attempt(name, action):
    try:
        action()
        result[name] = "DONE"
    except OSError as exc:
        result[name] = type(exc).__name__

attempt("list_jobs_root", lambda: os.listdir(os.path.dirname(target["home"])))
attempt("list_work_dir", lambda: os.listdir(target["home"]))
attempt("read_checkpoint", lambda: open(os.path.join(target["home"], "checkpoint.pt")).read())
attempt("overwrite_checkpoint", lambda: open(os.path.join(target["home"], "checkpoint.pt"), "w").write("pwned"))
attempt("write_work_dir", lambda: open(os.path.join(target["home"], "planted"), "w").write("x"))
attempt("read_temp", lambda: open(os.path.join(target["tmp"], "scratch")).read())
attempt("read_log", lambda: open(target["log"]).read())
attempt("list_state_dir", lambda: os.listdir(target["state"]))
attempt("read_outbox", lambda: open(os.path.join(target["state"], "state.sqlite3"), "rb").read())
attempt("read_environ", lambda: open("/proc/%d/environ" % target["pid"], "rb").read())
attempt("signal_victim", lambda: os.kill(target["pid"], 0))

# Everything else B can read that might hold a secret: every process's environment and command line,
# every file under the agent's var dir.
loot = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for name in ("environ", "cmdline"):
            try:
                loot.append(open("/proc/%s/%s" % (pid, name), "rb").read())
            except OSError:
                pass
for top, dirs, files in os.walk(target["var"]):
    for name in files:
        try:
            loot.append(open(os.path.join(top, name), "rb").read())
        except OSError:
            pass
with open(os.path.join(home, "loot"), "wb") as f:
    f.write(b"\0".join(loot))
print("RESULT=" + json.dumps(result), flush=True)
while not os.path.exists(os.path.join(home, "go")):
    time.sleep(0.1)
"""


def _submit(platform, tenant, command, env) -> int:
    session = platform.session_for(tenant)
    body = {"kind": "training", "gpus": 1, "command": command, "env": env}
    response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_tenant_b_cannot_reach_tenant_a_files_processes_or_the_node_token(platform, secure_agent):
    agent = secure_agent()
    acme, globex = TenantFactory(slug="acme"), TenantFactory(slug="globex")
    secret = "acme-secret-7f3a9c"

    a_id = _submit(platform, acme, [PY, "-c", VICTIM], {"SECRET_A": secret})
    a = json.loads(wait_output(agent, a_id, "READY=").split("READY=")[1].splitlines()[0])
    target = {
        **a,
        "log": str(job_log(agent, a_id)),
        "state": str(agent.var_dir / "agent" / agent.node),
        "var": str(agent.var_dir),
    }
    b_id = _submit(platform, globex, [PY, "-c", ATTACKER], {"TARGET": json.dumps(target)})
    b = job_result(wait_output(agent, b_id, "RESULT="))
    first, last = pool_uids(agent)

    # Every attack on A's files, log, outbox and process was refused by the kernel.
    for attack in (
        "list_jobs_root",
        "list_work_dir",
        "read_checkpoint",
        "overwrite_checkpoint",
        "write_work_dir",
        "read_temp",
        "read_log",
        "list_state_dir",
        "read_outbox",
        "read_environ",
        "signal_victim",
    ):
        assert b[attack] == "PermissionError", (attack, b)
    # Each job has its own uid from the pool, and no supplementary group.
    assert first <= a["uid"] <= last and first <= b["uid"] <= last and a["uid"] != b["uid"]
    assert b["groups"] == []
    # Nothing B could read anywhere holds A's secret or the node's token.
    loot = (job_dir(agent, b_id) / "loot").read_bytes()
    assert loot, "the attacker read nothing at all: the scan did not run"
    assert secret.encode() not in loot
    assert agent.token.encode() not in loot
    # A's files are intact and private.
    assert (job_dir(agent, a_id) / "checkpoint.pt").read_text() == secret
    mode = os.stat(job_dir(agent, a_id))
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == a["uid"]
    assert stat.S_IMODE(os.stat(job_log(agent, a_id)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(agent.var_dir / "agent" / agent.node).st_mode) == 0o700

    # The jobs end: their work dirs (and everything A wrote) are removed, their logs reached the platform.
    for job_id in (a_id, b_id):
        (job_dir(agent, job_id) / "go").touch()
    for job_id in (a_id, b_id):
        with scopes_disabled():
            wait_for(
                lambda j=job_id: Job.objects.get(pk=j).state == JobState.SUCCEEDED, timeout=60, what="the job to end"
            )
        wait_gone(job_dir(agent, job_id))
    assert f"A-LOG {secret}" in job_output(agent, a_id)


def test_a_job_that_fills_its_disk_bound_is_stopped_with_the_reason(platform, secure_agent):
    agent = secure_agent(extra=["--job-disk-mb", "8"])
    fill = (
        "import os, time\n"
        "with open(os.path.join(os.environ['TMPDIR'], 'fill'), 'wb') as f:\n"
        "    for _ in range(32):\n"
        "        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n"
        "print('WROTE', flush=True)\n"
        "time.sleep(120)\n"
    )
    job_id = _submit(platform, TenantFactory(slug="acme"), [PY, "-c", fill], {})
    with scopes_disabled():
        job = wait_for(
            lambda: (j := Job.objects.get(pk=job_id)).state in (JobState.FAILED, JobState.SUCCEEDED) and j,
            timeout=60,
            what="the job to be stopped",
        )
        assert "passed the job's bound of 8 MiB" in job.stop_reason
        assert job.events.filter(detail__contains="bound of 8 MiB").exists()
    wait_gone(job_dir(agent, job_id))
