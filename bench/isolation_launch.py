"""What tenant isolation costs at launch: idle submit -> the job's command
running, p50/p95, with the node agent single-tenant (jobs run as the agent's
user) and then multi-tenant (a uid per attempt from the pool, a fresh 0700 work
dir, the privilege drop in the agent's own code, the nft table kept in step).

Same stack, same node, same jobs (``sh -c 'date > stamp'`` of the vs-slurm
latency run), one after the other. Multi-tenant needs root; without it only
the single-tenant figure is measured.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .side_by_side import Ours, latency_run
from .stack import Stack, StackConfig
from .stats import Row, percentile
from .workload import workload


def _latency(stack, n: int, stamps: Path) -> list[float]:
    stamps.mkdir()
    os.chmod(stamps, 0o1777)  # job uids write their stamps here
    return latency_run(Ours(stack).submit_one, workload(n), stamps)


def run(ctx) -> tuple[list[Row], dict]:
    n = 8 if ctx.quick else 30
    # A stack of its own (it swaps the agent), on the dev settings: both agents' figures come from the same
    # platform, so only the difference matters (INFO logs: the harness waits for the worker's "ready.").
    # Its stack recreates the bench database and broker database: the shared stack must not run beside it (in
    # a full run its worker took this stack's reports and sent launches this agent refused as signed by an
    # untrusted key; docs/benchmarks.md, session 24).
    ctx.stack_stop()
    ctx.log("isolation: starting a platform stack of its own")
    config = StackConfig(extra_env={"LOG_LEVEL": "INFO", "DJANGO_SETTINGS_MODULE": "gpushare.settings.dev"})
    stack = Stack(ctx.workdir / "isolation", config)
    stamps = Path(tempfile.mkdtemp(prefix="gpushare-bench-stamps-"))
    os.chmod(stamps, 0o711)
    raw: dict = {}
    try:
        stack.start()  # inside the try: a stack that failed half-way is stopped too
        ctx.log(f"isolation: {n} idle launches, single-tenant agent")
        raw["single"] = _latency(stack, n, stamps / "single")
        if os.geteuid() == 0:
            from .tools import apt_install

            apt_install(("nftables",), binaries=("nft",))  # the multi-tenant agent's network policy
            work_root = Path(tempfile.mkdtemp(prefix="gpushare-bench-work-"))
            os.chmod(work_root, 0o711)
            stack.procs["agent"].stop()
            ctx.log("isolation: the same launches, multi-tenant agent (uid pool, private dirs, nft)")
            stack.agent_start(
                name="agent-multi",
                extra=("--tenancy", "multi", "--work-root", str(work_root / "jobs"), "--uid-pool", "210000-210999"),
                env={"GPUSHARE_AGENT_TENANCY": "multi"},
            )
            try:
                raw["multi"] = _latency(stack, n, stamps / "multi")
            finally:
                shutil.rmtree(work_root, ignore_errors=True)
    finally:
        stack.stop()
        shutil.rmtree(stamps, ignore_errors=True)
    rows = []
    for q in (50, 95):
        single = percentile(raw["single"], q)
        multi = percentile(raw["multi"], q) if "multi" in raw else None
        rows.append(
            Row(
                bench="isolation",
                metric=f"idle submit->running p{q}, multi-tenant vs single-tenant",
                ours=multi,
                unit="s",
                reference=single,
                reference_name="single-tenant agent",
                higher_is_better=False,
                runs=n,
                note="" if multi is not None else "not root: multi-tenant not measured",
            )
        )
    for mode, values in raw.items():
        ctx.log(f"  {mode}: p50 {percentile(values, 50):.3f}s p95 {percentile(values, 95):.3f}s")
    return rows, raw
