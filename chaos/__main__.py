"""``python -m chaos`` (``make chaos``): the fault-injection suite.

Each case starts a fresh platform stack (web server, Celery worker + beat, an
agent on simulated GPUs) on its own PostgreSQL database (gpushare_chaos) and
Redis db, injects one fault and checks what must still hold. Prints one line
per case (pass/fail, figures), writes bench/results/chaos.json, and exits 1
if any case fails.

    python -m chaos                     # every case
    python -m chaos --quick             # shorter cuts and smaller loads
    python -m chaos --only broker-cut   # one case (repeatable)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@dataclass
class Context:
    quick: bool
    workdir: Path
    stacks: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def stop_stacks(self) -> None:
        while self.stacks:
            self.stacks.pop().stop()


def main(argv: list[str] | None = None) -> int:
    from bench.stack import django_setup

    from .cases import CASES, CHAOS_DATABASE_URL, CHAOS_REDIS_URL, CaseResult

    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=sorted(CASES))
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-chaos-"))
    ctx = Context(quick=args.quick, workdir=workdir)
    from bench.stack import StackConfig

    django_setup(StackConfig(database_url=CHAOS_DATABASE_URL, redis_url=CHAOS_REDIS_URL), workdir / "var")
    results: list[CaseResult] = []
    for name in args.only or list(CASES):
        ctx.log(f"{name}: {CASES[name].__doc__.splitlines()[0]}")
        t0 = time.monotonic()
        try:
            result = CASES[name](ctx)
        except Exception:  # noqa: BLE001 - a case that blows up has failed
            result = CaseResult(name, False, error=traceback.format_exc()[-3000:])
        finally:
            ctx.stop_stacks()
        result.figures["seconds"] = round(time.monotonic() - t0, 1)
        results.append(result)
        mark = "PASS" if result.passed else "FAIL"
        ctx.log(f"{name}: {mark} {json.dumps(result.figures, default=str)}")
        for check, ok in result.checks.items():
            print(f"    [{'x' if ok else ' '}] {check}")
        if result.error:
            print(f"    error: {result.error}")
    print()
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name.ljust(width)}  {json.dumps(r.figures, default=str)}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps([asdict(r) for r in results], indent=2, default=str))
    failed = [r.name for r in results if not r.passed]
    ctx.log(f"{len(results) - len(failed)}/{len(results)} cases passed; logs in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
