"""Nothing privileged runs with the tenant's environment or paths.

- The API refuses (400, with the reason) the variables that steer a runtime,
  and image references that are not references (``--privileged``).
- The agent checks the image again and refuses it with the reason.
- The docker CLI runs with a fixed environment (a job's ``DOCKER_HOST`` and
  ``PATH`` never reach it), the job's variables travel in a 0600 env file,
  and the argv carries ``--cap-drop ALL``, ``no-new-privileges``, the job's
  pool uid, a pids limit, ``--`` before the image, and never ``--privileged``.
  No container engine runs on these machines: a recording stand-in for the
  docker CLI checks that contract on a real agent (docs/operator-guide.md).
- A job's ``PATH`` cannot make the agent run the tenant's program as root
  (the old cgroup shim found ``setpriv`` through it).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from django.test import override_settings

from agents.agent.cgroups import unified_mount
from tests.agents.conftest import launch_direct, wait_output
from tests.api.helpers import assert_error
from tests.factories import wait_for
from tests.security.conftest import PY, job_result, pool_uids

GOOD = {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"LD_PRELOAD": "/tmp/evil.so"}, "dynamic loader"),
        ({"LD_LIBRARY_PATH": "/tmp"}, "dynamic loader"),
        ({"LD_AUDIT": "/tmp/a.so"}, "dynamic loader"),
        ({"DOCKER_HOST": "tcp://10.0.0.1:2375"}, "docker client"),
        ({"DOCKER_CONFIG": "/tmp/evil"}, "docker client"),
        ({"docker_context": "evil"}, "docker client"),
        ({"GCONV_PATH": "/tmp"}, "glibc"),
        ({"GLIBC_TUNABLES": "glibc.malloc.x=1"}, "glibc"),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, "NVIDIA container runtime"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "CUDA"),
    ],
)
def test_the_api_refuses_variables_that_steer_a_runtime(rules, tenant, api_client_for, env, why):
    response = api_client_for(tenant).post("/api/v1/jobs/", {**GOOD, "env": env}, format="json")
    error = assert_error(response, 400, "invalid", "env")
    assert why in json.dumps(error), error


@pytest.mark.django_db
@pytest.mark.parametrize(
    "image",
    ["--privileged", "-v", "--volume=/:/host", "python:3.12 --privileged", "Ubuntu", "alpine bash", "a" * 600],
)
def test_the_api_refuses_what_is_not_an_image_reference(rules, tenant, api_client_for, image):
    response = api_client_for(tenant).post("/api/v1/jobs/", {**GOOD, "image": image}, format="json")
    assert_error(response, 400, "invalid", "image")


@pytest.mark.django_db
def test_the_api_keeps_to_the_operators_registries(rules, tenant, api_client_for):
    client = api_client_for(tenant)
    with override_settings(GPUSHARE={**_gpushare(), "ALLOWED_REGISTRIES": ("nvcr.io",)}):
        refused = client.post("/api/v1/jobs/", {**GOOD, "image": "ghcr.io/evil/miner:1"}, format="json")
        assert "not allowed here" in assert_error(refused, 400, "invalid", "image")["message"]
        ok = client.post("/api/v1/jobs/", {**GOOD, "image": "nvcr.io/nvidia/pytorch:24.05-py3"}, format="json")
        assert ok.status_code == 201, ok.content
    multi_line = client.post(
        "/api/v1/jobs/", {**GOOD, "image": "alpine:3", "env": {"A": "x\nNVIDIA_VISIBLE_DEVICES=all"}}, format="json"
    )
    assert_error(multi_line, 400, "invalid", "env")


def _gpushare() -> dict:
    from django.conf import settings

    return dict(settings.GPUSHARE)


FAKE_DOCKER = r"""#!/bin/sh
# A stand-in for the docker CLI: records how the agent called it, then runs the job's command
# as the container's --user would.
record="@RECORD@"
if [ "$1" = "version" ]; then echo 27.0.0; exit 0; fi
if [ "$1" = "network" ]; then echo "bridge false"; exit 0; fi  # the default bridge, "icc": false
env > "$record/env.$$"
printf '%s\n' "$@" > "$record/argv.$$"
while [ $# -gt 0 ]; do
  case "$1" in
    --env-file) stat -c '%a %u' "$2" > "$record/envfile-mode.$$"; cp "$2" "$record/envfile.$$"; shift 2;;
    --) shift; shift; break;;
    *) shift;;
  esac
done
echo "CONTAINER-RAN"
exec "$@"
"""


@pytest.mark.integration
def test_the_docker_cli_gets_a_fixed_environment_and_a_hardened_argv(secure_agent, tmp_path):
    record = Path(f"/tmp/gpushare-docker-record-{os.getpid()}")
    record.mkdir(mode=0o700, exist_ok=True)
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER.replace("@RECORD@", str(record)))
    docker.chmod(0o700)
    try:
        agent = secure_agent(extra=["--docker", str(docker), "--docker-pids-limit", "321"])
        first, last = pool_uids(agent)
        # What the API would refuse, sent straight to the node: the agent refuses it again.
        launch_direct(agent, 9701, ["true"], image="--privileged", env={})
        wait_for(lambda: "job 9701 attempt 1 not started: image refused" in agent.log(), timeout=30, what="refusal")
        assert not list(record.glob("argv.*")), "the docker CLI must never see an image that is an option"

        launch_direct(
            agent,
            9702,
            ["/bin/echo", "hello"],
            image="python:3.12-slim",
            env={"HF_TOKEN": "hf_secret_1", "DOCKER_HOST": "tcp://evil:2375", "PATH": "/evil/bin:/usr/bin"},
        )
        wait_output(agent, 9702, "CONTAINER-RAN")
        wait_for(lambda: "job 9702 attempt 1 ended" in agent.log(), timeout=30, what="the job's end")
        argv = next(record.glob("argv.*")).read_text().splitlines()
        env = dict(line.split("=", 1) for line in next(record.glob("env.*")).read_text().splitlines() if "=" in line)
        env_file = next(record.glob("envfile.*")).read_text()
        mode, owner = next(record.glob("envfile-mode.*")).read_text().split()
    finally:
        for path in record.iterdir():
            path.unlink()
        record.rmdir()
    # The CLI's own environment: fixed, nothing of the job's.
    assert "DOCKER_HOST" not in env and "HF_TOKEN" not in env and "hf_secret_1" not in json.dumps(env)
    assert env["PATH"].split(":")[0] != "/evil/bin" and "/evil/bin" not in env["PATH"]
    assert agent.token not in json.dumps(env)
    # The job's variables reach the container through an agent-only file.
    assert "HF_TOKEN=hf_secret_1" in env_file.splitlines()
    assert (mode, owner) == ("600", "0")
    assert not any("hf_secret_1" in a for a in argv)
    # The argv contract.
    assert "--privileged" not in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert argv[argv.index("--security-opt") + 1] == "no-new-privileges"
    assert argv[argv.index("--pids-limit") + 1] == "321"
    uid, gid = (int(x) for x in argv[argv.index("--user") + 1].split(":"))
    assert first <= uid <= last and gid == uid
    assert argv[argv.index("--") + 1 :] == ["python:3.12-slim", "/bin/echo", "hello"]
    assert not (agent.var_dir / "agent" / agent.node / "env" / "9702-1.env").exists()  # gone with the job
    assert stat.S_IMODE(os.stat(agent.var_dir / "agent" / agent.node / "env").st_mode) == 0o700


EVIL_SETPRIV = """#!/bin/sh
id -u > "@MARKER@"
exec "$@"
"""


@pytest.mark.integration
def test_a_jobs_path_cannot_put_its_programs_in_the_privileged_launch(secure_agent, tmp_path_factory):
    mount = unified_mount()
    assert mount is not None, "this host has no cgroup v2 hierarchy"
    cgroup_root = mount / f"gs-sec-{os.getpid()}"
    evil = Path(f"/tmp/gpushare-evil-{os.getpid()}")
    evil.mkdir(mode=0o755, exist_ok=True)
    os.chmod(evil, 0o777)
    marker = evil / "ran-as"
    for name in ("setpriv", "sh", "docker", "env", "python3"):
        (evil / name).write_text(EVIL_SETPRIV.replace("@MARKER@", str(marker)))
        (evil / name).chmod(0o755)
    try:
        agent = secure_agent(extra=["--cgroup-root", str(cgroup_root)])
        report = (
            "import json, os; print('RESULT=' + json.dumps({'uid': os.getuid(), "
            "'cgroup': open('/proc/self/cgroup').read()}), flush=True)"
        )
        launch_direct(
            agent,
            9711,
            [PY, "-c", report],
            env={"PATH": f"{evil}:/usr/bin:/bin", "LD_PRELOAD": f"{evil}/x.so", "BASH_ENV": f"{evil}/sh"},
        )
        result = job_result(wait_output(agent, 9711, "RESULT="))
        first, last = pool_uids(agent)
        assert first <= result["uid"] <= last
        assert f"/{cgroup_root.name}/job-9711-1" in result["cgroup"]  # joined its cgroup before dropping
        assert not marker.exists(), f"the tenant's program ran in the launch as uid {marker.read_text()}"
        agent.stop()
    finally:
        for path in evil.iterdir():
            path.unlink()
        evil.rmdir()
        for child in cgroup_root.glob("job-*"):
            child.rmdir()
        if cgroup_root.exists():
            cgroup_root.rmdir()
