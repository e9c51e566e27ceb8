"""``python -m gpushare.observability.probe worker|beat|URL [--max-age S]``: a readiness probe.

``worker`` / ``beat``: exit 0 when the role's heartbeat is fresh and its checks
passed, 1 otherwise, printing why (Kubernetes shows it in the pod's events,
compose in ``docker compose ps``). It reads a file: no Django setup, no broker
round trip. ``URL`` (``http://127.0.0.1:8000/readyz``): exit 0 on a 200, for
images without curl (the compose health checks of web, gateway and agent).
"""

from __future__ import annotations

import argparse
import json
import sys

from .heartbeat import DEFAULT_MAX_AGE_S, heartbeat_read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.observability.probe")
    parser.add_argument("target", help="worker, beat, or a URL to GET")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S, help="seconds (default %(default)s)")
    args = parser.parse_args(argv)
    if args.target.startswith(("http://", "https://")):
        return url_probe(args.target)
    if args.target not in ("worker", "beat"):
        parser.error("target must be worker, beat or a URL")
    ready, report = heartbeat_read(args.target, max_age_s=args.max_age)
    print(json.dumps(report))
    return 0 if ready else 1


def url_probe(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            print(response.read(2000).decode(errors="replace"))
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(exc.read(2000).decode(errors="replace"))
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(json.dumps({"ready": False, "reason": str(exc)}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
