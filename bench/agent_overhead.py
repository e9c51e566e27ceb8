"""Benchmark: the node agent's own CPU per GPU at 1 Hz sampling.

An extra agent process (8 GPUs, ``--sample-interval 1``, default window and
heartbeat) joins the bench stack; the stack's own node is cordoned so that
8 one-GPU ``sleep`` jobs land on it; once they run, the agent process's CPU
time (user + system, its job processes excluded) is read over a window.
Backends: the simulated one, and the fake NVML library (tests/fake_nvml,
loaded through LD_LIBRARY_PATH as a real libnvidia-ml would be).
Goal: < 1% of one core per GPU.
"""

from __future__ import annotations

import time

import psutil

from .stats import Row

GPUS = 8


def fake_nvml_env(workdir) -> dict:
    from tests.fake_nvml import FakeGpu, FakeNvml, build

    lib_dir = build(workdir / "fake-nvml")
    state = FakeNvml(
        path=workdir / "fake-nvml.conf",
        gpus=[FakeGpu(uuid=f"GPU-bench0000-0000-0000-0000-{i:012d}", power_mw=300_000, util=50) for i in range(GPUS)],
    )
    state.save()
    return {"LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_CONFIG": str(state.path)}


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def measure(ctx, stack, *, backend: str, seconds: float) -> dict:
    from agents.services import node_credential_issue
    from scheduler.models import Job, JobState

    node = f"bench-agent-{backend}"
    token = node_credential_issue(name=node)
    if backend == "sim":
        gpus, env = f"sim:{GPUS}xH100-80GB", {}
    else:
        gpus, env = "nvml", fake_nvml_env(ctx.workdir)
    proc = stack.agent_start(
        name=f"agent-{backend}",
        node=node,
        token=token,
        gpus=gpus,
        sample_interval_s=1.0,
        window_s=10.0,
        heartbeat_s=5.0,
        env=env,
    )
    session = stack.session()
    ids = []
    try:
        stack.node_state_set("cordoned")
        body = {"kind": "training", "gpus": 1, "command": ["sleep", "900"]}
        ids = [session.post(f"{stack.url}/api/v1/jobs/", json=body, timeout=30).json()["id"] for _ in range(GPUS)]
        from django_scopes import scopes_disabled

        with scopes_disabled():
            running = lambda: Job.objects.filter(pk__in=ids, state=JobState.RUNNING).count()  # noqa: E731
            stack.wait(lambda: running() == GPUS, 90, f"{GPUS} jobs running on {node}", f"agent-{backend}")
        time.sleep(3)  # let the launch settle
        pid = proc.proc.pid
        c0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(pid), time.monotonic()
        core_share = (c1 - c0) / (t1 - t0)
        per_gpu_pct = core_share / GPUS * 100
        ctx.log(
            f"  agent {backend}: {c1 - c0:.2f} CPU-s over {t1 - t0:.0f}s with {GPUS} jobs: "
            f"{per_gpu_pct:.3f}% of a core per GPU"
        )
        return {
            "backend": backend,
            "cpu_s": c1 - c0,
            "wall_s": t1 - t0,
            "per_gpu_pct": per_gpu_pct,
            "rss_mb": psutil.Process(pid).memory_info().rss / 2**20,
        }
    finally:
        for job_id in ids:
            session.post(f"{stack.url}/api/v1/jobs/{job_id}/cancel/", timeout=30)
        stack.node_state_set("up")
        try:
            with scopes_disabled():
                stack.wait(
                    lambda: (
                        Job.objects.filter(pk__in=ids, state__in=[JobState.RUNNING, JobState.SCHEDULED]).count() == 0
                    ),
                    60,
                    "the jobs to stop",
                )
        finally:
            proc.stop()
            stack.node_state_set("cordoned", node)


def run(ctx) -> tuple[list[Row], dict]:
    stack = ctx.stack()
    seconds = 10 if ctx.quick else 20
    results = {backend: measure(ctx, stack, backend=backend, seconds=seconds) for backend in ("sim", "fake-nvml")}
    rows = [
        Row(
            "agent",
            f"CPU per GPU, 1 Hz, {backend} backend",
            r["per_gpu_pct"],
            "% core",
            higher_is_better=False,
            goal="< 1% of a core",
            goal_met=r["per_gpu_pct"] < 1.0,
            runs=1,
            note=f"{GPUS} jobs running, {r['wall_s']:.0f}s, RSS {r['rss_mb']:.0f} MB",
        )
        for backend, r in results.items()
    ]
    return rows, results
