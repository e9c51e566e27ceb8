"""``python -m gpushare.observability.probe worker|beat [--max-age S]``: the readiness probe.

Exit 0 when the role's heartbeat is fresh and its checks passed, 1 otherwise,
printing why (Kubernetes shows it in the pod's events, compose in
``docker compose ps``). It reads a file: no Django setup, no broker round trip.
"""

from __future__ import annotations

import argparse
import json
import sys

from .heartbeat import DEFAULT_MAX_AGE_S, heartbeat_read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.observability.probe")
    parser.add_argument("role", choices=["worker", "beat"])
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S, help="seconds (default %(default)s)")
    args = parser.parse_args(argv)
    ready, report = heartbeat_read(args.role, max_age_s=args.max_age)
    print(json.dumps(report))
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
