"""Pinning by UUID and the job's environment, with a real agent process on Redis."""

from __future__ import annotations

import sys

import pytest
from django_scopes import scopes_disabled

from scheduler.models import Job
from tests.agents.conftest import env_dump_command, job_dir, launch_direct, parse_env_dump, wait_output
from tests.factories import TenantFactory, wait_for

pytestmark = pytest.mark.integration

PRINT_AND_HOLD = "import os, time; print('visible=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(3)"


def test_two_dedicated_jobs_never_see_the_same_gpu(platform, agent_factory, node):
    agent = agent_factory(node, gpus="sim:2xH100-80GB")
    session = platform.session_for(TenantFactory(slug="acme"))
    ids = []
    for _ in range(2):
        body = {"kind": "training", "gpus": 1, "command": [sys.executable, "-c", PRINT_AND_HOLD]}
        response = session.post(f"{platform.url}/api/v1/jobs/", json=body, timeout=10)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    seen = [wait_output(agent, job_id, "visible=").split("visible=")[1].split()[0] for job_id in ids]
    with scopes_disabled():
        allocated = [list(Job.objects.get(pk=i).allocations.values_list("gpu__uuid", flat=True)) for i in ids]
    assert [[s] for s in seen] == allocated
    assert seen[0] != seen[1]
    assert all(s.startswith("GPU-") for s in seen)


def test_a_no_gpu_launch_sees_an_empty_device_list_not_all(agent_factory, node):
    agent = agent_factory(node)
    launch_direct(agent, 7001, env_dump_command(), gpu_uuids=[])
    env = parse_env_dump(wait_output(agent, 7001, "ENV="))
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # present and empty: hides every GPU (unset would show all)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_pinned_launch_sets_both_device_variables(agent_factory, node):
    agent = agent_factory(node)
    from agents.models import Gpu

    uuids = list(Gpu.objects.filter(node__name=node).order_by("index").values_list("uuid", flat=True)[:2])
    launch_direct(agent, 7002, env_dump_command(), gpu_uuids=uuids, share_milli=1000)
    env = parse_env_dump(wait_output(agent, 7002, "ENV="))
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)


def test_the_agents_own_environment_never_reaches_the_job(agent_factory, monkeypatch, node):
    secret = "gpn_this-must-never-reach-a-job"
    monkeypatch.setenv("GPUSHARE_AGENT_TOKEN", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value")
    monkeypatch.setenv("PGPASSWORD", "pg-secret-value")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/agent-only/lib")
    monkeypatch.setenv("LANG", "C.UTF-8")
    agent = agent_factory(node)
    from agents.models import Gpu

    uuid = Gpu.objects.filter(node__name=node).order_by("index").values_list("uuid", flat=True).first()
    launch_direct(
        agent,
        7003,
        env_dump_command(),
        gpu_uuids=[uuid],
        grace_s=7,
        env={
            "CUDA_VISIBLE_DEVICES": "all",
            "NVIDIA_VISIBLE_DEVICES": "all",
            "cuda_mps_pipe_directory": "/tmp/elsewhere",
            "LD_PRELOAD": "/tmp/evil.so",
            "GPUSHARE_JOB_ID": "1",
            "MODEL_NAME": "llama",
        },
    )
    env = parse_env_dump(wait_output(agent, 7003, "ENV="))
    # The agent's credentials and configuration stay with the agent.
    for name in ("GPUSHARE_AGENT_TOKEN", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD", "REDIS_URL", "LD_LIBRARY_PATH"):
        assert name not in env, name
    assert not any(secret in value or "secret-value" in value for value in env.values())
    assert not any(agent.token in value for value in env.values())
    # The job's own variables arrive, but cannot override what the agent decides.
    assert env["MODEL_NAME"] == "llama"
    assert env["CUDA_VISIBLE_DEVICES"] == uuid and env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert "LD_PRELOAD" not in env and "cuda_mps_pipe_directory" not in env
    assert env["GPUSHARE_JOB_ID"] == "7003"
    assert env["GPUSHARE_GRACE_SECONDS"] == "7"
    assert env["LANG"] == "C.UTF-8"  # allow-listed
    assert env["HOME"].endswith("/7003-1")


def test_an_image_job_without_a_docker_engine_fails_with_a_clear_reason(agent_factory, node):
    agent = agent_factory(node)
    launch_direct(agent, 7004, ["python", "-V"], gpu_uuids=[], image="python:3.12-slim")
    wait_for(
        lambda: "no docker engine answers on this node" in agent.log(),
        timeout=60,
        what="the agent to refuse the image job",
    )
    assert not job_dir(agent, 7004).exists()


def test_run_as_drops_to_the_user_and_its_supplementary_groups(agent_factory, node):
    import os
    import pwd

    nobody = pwd.getpwnam("nobody")
    agent = agent_factory(node, extra=["--run-as", "nobody"])
    launch_direct(agent, 7005, ["/bin/sh", "-c", "echo ids=$(/usr/bin/id -u):$(/usr/bin/id -g):$(/usr/bin/id -G)"])
    if os.geteuid() == 0:
        output = wait_output(agent, 7005, "ids=")
        uid, gid, groups = output.split("ids=")[1].split()[0].split(":")
        assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid)
        assert groups == str(nobody.pw_gid)  # root's supplementary groups are gone
    else:  # an unprivileged agent cannot switch users: the job fails to start, and says why
        assert "could not start" in wait_output(agent, 7005, "could not start")
