"""``python -m bench``: run the benchmarks, print one table, write bench/results/<name>.json.

Each benchmark prints our figure, the reference measured in the same run on
the same machine, and the ratio (> 1 means we are ahead). Exit status 0
unless the harness itself failed: a missed speed goal is reported, not an error.

    python -m bench                 # everything (about 15 minutes on 2 cores)
    python -m bench --quick         # smaller sizes, for development
    python -m bench --only ingest   # one benchmark (repeat --only for several)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .stats import Row, table_markdown, table_text

RESULTS = Path(__file__).resolve().parent / "results"

# name -> module; each module has run(ctx) -> (rows, raw). The scheduler
# helper's modules (run(quick) -> dict) are called when present.
BENCHMARKS = {
    "vs-slurm": "bench.side_by_side",
    "scheduler-scale": "bench.scheduler_scale",
    "packing": "bench.packing_alibaba",
    "ingest": "bench.ingest",
    "api": "bench.api_load",
    "agent": "bench.agent_overhead",
    "invoice": "bench.invoice_close",
    "gateway": "bench.endpoints_gateway",
    "isolation": "bench.isolation_launch",
}
EXTERNAL = {"scheduler-scale", "packing", "gateway"}


@dataclass
class Context:
    quick: bool
    workdir: Path
    _stack: object = None
    started: float = field(default_factory=time.monotonic)

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def stack(self):
        """The platform stack, started on first use and shared by the benchmarks."""
        if self._stack is None:
            from .stack import Stack

            self.log("starting the platform stack (web server, celery worker + beat, agent on 8 simulated H100s)")
            self._stack = Stack(self.workdir / "stack").start()
            self.log(f"stack up at {self._stack.url}")
        return self._stack

    def stack_stop(self) -> None:
        """Stop the shared stack, if one runs (a later ``stack()`` starts a fresh one): for a benchmark that
        starts a stack of its own on the same database and broker database, where the shared stack's worker
        would otherwise take its reports and send its node commands signed with the other stack's key."""
        if self._stack is not None:
            self.log("stopping the shared platform stack")
            self._stack.stop()
            self._stack = None

    def close(self) -> None:
        self.stack_stop()


def external_rows(name: str, raw: dict) -> list[Row]:
    """Rows from a module that returns a plain dict: its ``rows`` if it has them, else one per number."""
    if isinstance(raw.get("rows"), list):
        fields = set(Row.__dataclass_fields__)
        return [Row(**{k: v for k, v in r.items() if k in fields}) for r in raw["rows"]]
    rows = []
    for key, value in raw.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            rows.append(Row(name, key, float(value), ""))
    return rows


def machine() -> dict:
    info = {
        "python": sys.version.split()[0],
        # Which build: the OS's (PGO + LTO) or a version manager's runs the same code 20-30% apart (Makefile).
        "python_interpreter": os.path.realpath(sys.executable),  # through the venv's link, to the build
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        info["cpu"] = model[0].split(":", 1)[1].strip() if model else ""
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gb"] = round(int(mem) / 1024 / 1024, 1)
    except OSError:
        pass
    return info


def report_markdown(folder: Path) -> str:
    """The stored results (bench/results/*.json) as Markdown tables, for docs/benchmarks.md."""
    fields = set(Row.__dataclass_fields__)
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if path.stem == "chaos":
            out.append("### chaos\n\n| case | result | figures |\n|---|---|---|")
            for case in data:
                figures = ", ".join(f"{k}={v}" for k, v in case["figures"].items())
                out.append(f"| {case['name']} | {'PASS' if case['passed'] else 'FAIL'} | {figures} |")
            out.append("")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue  # another tool's file
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
        load = data.get("load_average_before")
        load_text = f", load average {load[0]:.1f} before" if load else ""
        kind = "quick" if data.get("quick") else "full"
        out.append(
            f"### {data.get('name', path.stem)} ({kind} run at {data.get('at')}, "
            f"{data.get('seconds', 0):.0f} s{load_text})\n"
        )
        out.append(table_markdown(rows))
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (development)")
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS), help="run only this benchmark")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    parser.add_argument("--report", action="store_true", help="print the stored results as Markdown; run nothing")
    args = parser.parse_args(argv)
    if args.report:
        print(report_markdown(RESULTS))
        return 0
    names = args.only or list(BENCHMARKS)
    RESULTS.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-bench-"))
    ctx = Context(quick=args.quick, workdir=workdir)
    ctx.log(f"work directory {workdir}; {'quick' if args.quick else 'full'} run of {', '.join(names)}")
    all_rows: list[Row] = []
    failed: list[str] = []
    try:
        for name in names:
            try:
                module = importlib.import_module(BENCHMARKS[name])
            except ModuleNotFoundError as exc:
                if name in EXTERNAL and exc.name == BENCHMARKS[name]:
                    ctx.log(f"{name}: {BENCHMARKS[name]} is not there yet; skipped")
                    continue
                raise
            load_before = os.getloadavg()
            ctx.log(f"{name}: running (load average {load_before[0]:.1f} on {os.cpu_count()} CPUs)")
            started = time.monotonic()
            try:
                if name in EXTERNAL:
                    raw = module.run(quick=args.quick)
                    rows = external_rows(name, raw)
                else:
                    rows, raw = module.run(ctx)
            except Exception:  # noqa: BLE001 - report it, go on with the others, exit non-zero
                failed.append(name)
                ctx.log(f"{name}: HARNESS ERROR\n{traceback.format_exc()}")
                continue
            elapsed = time.monotonic() - started
            all_rows += rows
            payload = {
                "name": name,
                "quick": args.quick,
                "seconds": elapsed,
                "machine": machine(),
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "rows": [r.as_dict() for r in rows],
                "raw": raw,
            }
            (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
            ctx.log(f"{name}: done in {elapsed:.0f}s\n{table_text(rows)}")
    finally:
        ctx.close()
    print()
    print(table_text(all_rows))
    if args.markdown:
        print()
        print(table_markdown(all_rows))
    ctx.log(f"results in {RESULTS}/; logs in {workdir}")
    if failed:
        print(f"harness error in: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
