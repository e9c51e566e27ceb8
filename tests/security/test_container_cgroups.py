"""An image job's container lives in the job's cgroup, so it is metered, stopped and cleaned up
like a process job (issue #15, point 6).

No container engine runs on these machines: ``fake_engine.py`` stands in for the docker CLI and
an engine with the cgroupfs driver (it puts the container in ``<--cgroup-parent>/docker-<name>``,
in a session of its own, as the real engine does), on a real agent with real cgroups v2.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.dispatch import node_send
from tests.agents.conftest import GPU0, launch_direct, unique_node_name, wait_output
from tests.factories import wait_for
from tests.processes import free_port
from tests.security.conftest import PY

pytestmark = pytest.mark.integration

# Network isolation is test_network.py's (and needs nftables, which not every dev machine has).
NO_NFT = ["--network-policy", "off"]
IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"
SLEEPER = "import os, time; print('PID=%d' % os.getpid(), flush=True); time.sleep(120)"
# The container's main process ignores SIGTERM; its worker left the session and checkpoints on SIGTERM.
WORKER = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    def checkpoint(*_):
        os.write(1, b'WORKER-CHECKPOINTED\n')
        os._exit(0)
    signal.signal(signal.SIGTERM, checkpoint)
    os.write(1, ('WORKER=%d\n' % os.getpid()).encode())
    while True:
        time.sleep(0.1)
os.write(1, ('MAIN=%d\n' % os.getpid()).encode())
while True:
    time.sleep(0.1)
"""


def _value(output: str, key: str) -> int:
    return int(output.split(f"{key}=")[1].split()[0])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cgroup(pid: int) -> str:
    """The process's cgroup v2, read here (not through the agent's code)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line[3:] for line in lines if line.startswith("0::"))


def _container(job_id: int) -> str:
    return f"docker-gpushare-job-{job_id}-1"


def _both(agent, job_id: int) -> tuple[int, int]:
    output = wait_for(
        lambda: "WORKER=" in (out := wait_output(agent, job_id, "MAIN=")) and out, timeout=45, what="main and worker"
    )
    return _value(output, "MAIN"), _value(output, "WORKER")


def _job_use(port: int) -> dict[str, tuple[float, float]]:
    """job id -> (GPU memory MiB, SM %) as the agent meters it (its Prometheus series)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpushare_job_fb_used_mib":
                found.setdefault(sample.labels["job"], [0.0, 0.0])[0] = sample.value
            elif sample.name == "gpushare_job_sm_util_percent":
                found.setdefault(sample.labels["job"], [0.0, 0.0])[1] = sample.value
    return {job: (memory, sm) for job, (memory, sm) in found.items()}


def test_a_containers_gpu_use_is_metered_to_its_own_job(
    engine, jobs_cgroup, secure_agent, fake_nvml, fake_nvml_dir, monkeypatch
):
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_nvml_dir))
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(fake_nvml.path))
    port = free_port()
    agent = secure_agent(
        gpus="nvml",
        extra=[*NO_NFT, "--docker", str(engine.docker), "--cgroup-root", str(jobs_cgroup), "--metrics-port", str(port)],
    )
    # Two tenants' containers on one GPU, half each.
    for job_id, tenant in ((9801, "acme"), (9802, "globex")):
        launch_direct(agent, job_id, [PY, "-c", SLEEPER], image=IMAGE, tenant=tenant, gpu_uuids=[GPU0], share_milli=500)
    pid_a, pid_b = (_value(wait_output(agent, job_id, "PID="), "PID") for job_id in (9801, 9802))
    # Like a real container's, the process is outside the agent's process groups: only its cgroup says whose it is.
    assert os.getsid(pid_a) == pid_a and os.getsid(pid_b) == pid_b

    # The driver sees both containers' processes (host pids, as NVML reports them).
    fake_nvml.proc_add(0, pid_a, memory_mb=3000, sm_util=30)
    fake_nvml.proc_add(0, pid_b, memory_mb=7000, sm_util=60)

    def both_metered():
        use = _job_use(port)
        return use if all(all(use.get(job, (0, 0))) for job in ("9801", "9802")) else None

    metered = wait_for(both_metered, timeout=30, what="both containers' GPU use metered")
    assert metered["9801"] == (3000, 30)  # its own process only, never the other tenant's
    assert metered["9802"] == (7000, 60)
    # What made it so: the container's cgroup is below the job's, named to docker as --cgroup-parent.
    assert _cgroup(pid_a) == f"/{jobs_cgroup.name}/job-9801-1/{_container(9801)}"
    argv = (engine.state / "gpushare-job-9801-1.argv").read_text().splitlines()
    assert argv[argv.index("--cgroup-parent") + 1] == f"/{jobs_cgroup.name}/job-9801-1"
    fake_nvml.procs = []
    fake_nvml.save()
    agent.stop()
    assert not [p.name for p in jobs_cgroup.iterdir() if p.is_dir()]  # every job cgroup removed


def test_stopping_a_container_job_stops_every_process_in_it(engine, jobs_cgroup, secure_agent):
    agent = secure_agent(extra=[*NO_NFT, "--docker", str(engine.docker), "--cgroup-root", str(jobs_cgroup)])
    launch_direct(agent, 9811, [PY, "-c", WORKER], image=IMAGE, tenant="acme", grace_s=2)
    main, worker = _both(agent, 9811)

    node_send(agent.node, "agent.stop", {"job_id": 9811, "attempt": 1, "reason": "test stop", "grace_s": 2})
    # The stop's SIGTERM reaches every process of the container (docker run passes it to the main
    # process only), so the worker checkpoints; the main process, which ignores it, is killed after the grace.
    wait_output(agent, 9811, "WORKER-CHECKPOINTED", timeout=30)
    wait_for(lambda: not _alive(main) and not _alive(worker), timeout=30, what="the container's processes gone")
    wait_for(lambda: "job 9811 attempt 1 ended" in agent.log(), timeout=30, what="the end reported")
    assert not (jobs_cgroup / "job-9811-1").exists()


def test_a_container_whose_docker_client_died_is_killed_before_its_job_ends(engine, jobs_cgroup, agent_factory):
    """``docker run`` can die while its container runs on (the engine restarted, the client was
    OOM-killed). The job is not over, and its GPUs not free, until the container is gone too.
    Single-tenant, as in the next test: no pool uid to find the container's processes by (nor is
    there one on a multi-tenant node whose engine remaps uids), only the job's cgroup."""
    agent = agent_factory(unique_node_name(), extra=["--docker", str(engine.docker), "--cgroup-root", str(jobs_cgroup)])
    launch_direct(agent, 9821, [PY, "-c", WORKER], image=IMAGE, grace_s=2)
    main, worker = _both(agent, 9821)
    client = psutil.Process(main).parent()  # the stand-in's client half started it
    assert str(engine.docker) in client.cmdline()
    os.kill(client.pid, signal.SIGKILL)  # the client, not the engine: its container's cgroup stays behind

    wait_for(lambda: not _alive(main) and not _alive(worker), timeout=30, what="the container killed with its job")
    wait_for(lambda: "job 9821 attempt 1 ended" in agent.log(), timeout=30, what="the end reported")
    assert not (jobs_cgroup / "job-9821-1").exists()  # with the child cgroup the engine never removed


def test_a_restarted_agent_kills_the_containers_its_previous_run_left(engine, jobs_cgroup, agent_factory):
    """The job's cgroup is what finds the container (single-tenant: no pool uid to find it by)."""
    agent = agent_factory(unique_node_name(), extra=["--docker", str(engine.docker), "--cgroup-root", str(jobs_cgroup)])
    launch_direct(agent, 9831, [PY, "-c", WORKER], image=IMAGE)
    main, worker = _both(agent, 9831)
    agent.kill()  # a crash: the client and its container run on
    assert _alive(main) and _alive(worker)

    agent.start()
    wait_for(lambda: agent.log().count(" up: ") >= 2, timeout=30, what="the agent back up")
    wait_for(lambda: not _alive(main) and not _alive(worker), timeout=30, what="the leftover container killed")
    assert "killed the processes left in cgroup job-9831-1 by a previous run" in agent.log()
    assert not (jobs_cgroup / "job-9831-1").exists()
    agent.stop()


@pytest.mark.parametrize(
    ("network", "said"),
    [
        ("bridge true", "lets containers reach each other"),
        ("bridge <no value>", "lets containers reach each other"),  # a bridge made without the option
        ("overlay <no value>", "uses the 'overlay' driver"),
    ],
)
def test_a_multi_tenant_node_refuses_containers_on_a_network_where_they_reach_each_other(
    engine, secure_agent, network, said
):
    """Bridged traffic between two containers never crosses the node's nft table: a container of
    tenant B could connect to tenant A's replica. The node refuses the job, saying why and how to fix it."""
    (engine.state / "network").write_text(network)
    agent = secure_agent(extra=[*NO_NFT, "--docker", str(engine.docker)])
    launch_direct(agent, 9841, [PY, "-c", "print('RAN')"], image=IMAGE, tenant="acme")
    wait_for(lambda: "job 9841 attempt 1 not started" in agent.log(), timeout=30, what="the job refused")
    assert said in agent.log()
    assert not (engine.state / "gpushare-job-9841-1.argv").exists()  # no container was started
