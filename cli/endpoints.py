"""``gpushare endpoint deploy|list|logs|scale|delete``: inference endpoints by name.

The commands find an endpoint by its name (``GET /api/v1/endpoints/?name=``, an
exact match within the token's tenant); an unknown name exits 125 like any other
refusal. ``deploy`` is declarative: it creates the endpoint, or, when one of that
name exists, changes the fields given (a change of what replicas run is a rolling
update to a new version). A replica is a job, so its log is the job's log.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from .client import ApiError, Client
from .common import (
    EXIT_TIMEOUT,
    EXIT_USAGE,
    LogFollower,
    UsageError,
    command_arg,
    env_merge,
    err,
    fields_load,
    gpus_arg,
    outage_patience,
    poll_interval,
    print_out,
    transient,
)

# The fields of the API's deploy body (and of a deploy file).
ENDPOINT_FIELDS = (
    "name",
    "command",
    "image",
    "env",
    "gpus",
    "gpu_model",
    "priority",
    "min_replicas",
    "max_replicas",
    "concurrency_target",
    "idle_timeout_seconds",
    "health_path",
)
# deploy's flags (argparse dest) -> API field.
FLAG_FIELDS = {
    "gpus": "gpus",
    "gpu_model": "gpu_model",
    "image": "image",
    "priority": "priority",
    "min": "min_replicas",
    "max": "max_replicas",
    "concurrency": "concurrency_target",
    "idle_timeout": "idle_timeout_seconds",
    "health_path": "health_path",
}
DEFAULT_GPUS = 0.25  # a new endpoint's slice when neither --gpus nor the file says


def endpoint_find(client: Client, name: str) -> dict:
    found = client.endpoints(name=name)
    if not found:
        raise ApiError(f"no endpoint named {name}", status=404, code="not_found")
    return found[0]


def _counts(endpoint: dict) -> tuple[int, int]:
    """(ready, live) replicas; the API lists only live ones."""
    replicas = endpoint["replicas"]
    return sum(r["state"] == "ready" for r in replicas), len(replicas)


def _summary(endpoint: dict) -> list[str]:
    ready, live = _counts(endpoint)
    replicas = f"{ready} ready / {live} live (min {endpoint['min_replicas']}, max {endpoint['max_replicas']})"
    return [
        f"  url       {endpoint['url']}  (on the gateway)",
        f"  state     {endpoint['state']}, version {endpoint['version']}",
        f"  replicas  {replicas}",
    ]


# --- deploy ---------------------------------------------------------------------


def endpoint_body(args) -> dict:
    """The fields to deploy: the -f file, then the flags over it. The name is NAME, not part of the body."""
    body = fields_load(args.file, ENDPOINT_FIELDS, "endpoint") if args.file else {}
    named = body.pop("name", args.name)
    if named != args.name:
        raise UsageError(f"{args.file} names the endpoint {named!r}, the command line {args.name!r}")
    for flag, field in FLAG_FIELDS.items():
        value = getattr(args, flag)
        if value is not None:
            body[field] = value
    if args.env:
        body["env"] = env_merge(body.get("env"), args.env)
    command = command_arg(args.command)
    if command:
        body["command"] = command
    return body


def _create(client: Client, name: str, body: dict) -> dict:
    if not body.get("command"):
        raise UsageError(f"no command: put it after '--' (gpushare endpoint deploy {name} -- python serve.py) or in -f")
    return client.endpoint_create({"name": name, "gpus": DEFAULT_GPUS, **body})


def cmd_deploy(client: Client, args) -> int:
    body = endpoint_body(args)
    before = next(iter(client.endpoints(name=args.name)), None)
    endpoint = None
    if before is None:
        try:
            endpoint = _create(client, args.name, body)
        except ApiError as exc:
            if exc.code != "conflict":
                raise
            # Created meanwhile: a retried POST whose first answer was lost, or a concurrent deploy.
            before = endpoint_find(client, args.name)
    if endpoint is None:
        endpoint = client.endpoint_update(before["id"], body)
    if before is None:
        verb = f"created (version {endpoint['version']})"
    elif endpoint["version"] != before["version"]:
        new, old = endpoint["version"], before["version"]
        verb = f"updated: rolling out version {new} (replicas of version {old} drain once it serves)"
    else:
        verb = f"updated (still version {endpoint['version']}: nothing that replicas run changed)"
    if not args.json:
        print_out(endpoint, False, [f"endpoint {endpoint['name']} {verb}", *_summary(endpoint)])
    code = wait_ready(client, endpoint, timeout=args.timeout) if args.wait else 0
    if args.json:
        print(json.dumps(client.endpoint(endpoint["id"]) if args.wait else endpoint))
    return code


def _ready_replica(endpoint: dict) -> dict | None:
    """A ready replica of the endpoint's current version (an older version's does not count)."""
    return next(
        (r for r in endpoint["replicas"] if r["state"] == "ready" and r["version"] == endpoint["version"]), None
    )


def wait_ready(client: Client, endpoint: dict, *, timeout: float | None) -> int:
    """Poll until a replica of the current version is ready: 0, or EXIT_TIMEOUT after ``timeout`` seconds.

    An endpoint with min_replicas 0 starts no replica until its first request,
    so there is nothing to wait for. Platform outages are waited out as for jobs.
    """
    name = endpoint["name"]
    deadline = time.monotonic() + timeout if timeout else None
    seen = outage_since = None
    while True:
        replica = _ready_replica(endpoint)
        if replica is not None:
            err(f"endpoint {name}: replica {replica['id']} of version {endpoint['version']} is ready")
            return 0
        if endpoint["min_replicas"] == 0:
            err(f"endpoint {name} scales from zero: its first request starts a replica (min 0, nothing to wait for)")
            return 0
        states = sorted(r["state"] for r in endpoint["replicas"] if r["version"] == endpoint["version"])
        if states != seen:
            err(f"endpoint {name} version {endpoint['version']}: replicas {', '.join(states) or 'none yet'}")
            seen = states
        if deadline is not None and time.monotonic() > deadline:
            err(f"endpoint {name}: no replica of version {endpoint['version']} ready after --timeout {timeout:g}s")
            return EXIT_TIMEOUT
        time.sleep(poll_interval())
        try:
            endpoint = client.endpoint(endpoint["id"])
        except ApiError as exc:
            if not transient(exc):
                raise
            outage_since = outage_since or time.monotonic()
            if time.monotonic() - outage_since > outage_patience():
                raise
            err(f"platform unreachable, still waiting: {exc}")
            continue
        outage_since = None


# --- list, scale, delete ------------------------------------------------------------


def cmd_list(client: Client, args) -> int:
    endpoints = client.endpoints()
    if args.json:
        print(json.dumps(endpoints))
        return 0
    rows = [
        (
            e["name"],
            str(e["version"]),
            "{}/{}".format(*_counts(e)),
            f"{e['min_replicas']}-{e['max_replicas']}",
            str(e["gpus"]),
            e["cost"],
            e["url"],
        )
        for e in endpoints
    ]
    header = ("NAME", "VERSION", "READY/LIVE", "MIN-MAX", "GPUS", "COST", "URL")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_scale(client: Client, args) -> int:
    if args.min is None and args.max is None:
        raise UsageError("scale needs --min, --max or both")
    endpoint = endpoint_find(client, args.name)
    was = f"{endpoint['min_replicas']}-{endpoint['max_replicas']}"
    low = endpoint["min_replicas"] if args.min is None else args.min
    high = endpoint["max_replicas"] if args.max is None else args.max
    endpoint = client.endpoint_scale(endpoint["id"], min_replicas=low, max_replicas=high)
    lines = [f"endpoint {endpoint['name']}: min {endpoint['min_replicas']}, max {endpoint['max_replicas']} (was {was})"]
    print_out(endpoint, args.json, lines)
    return 0


def _confirm(question: str) -> bool:
    print(question, end=" [y/N] ", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def cmd_delete(client: Client, args) -> int:
    if not args.yes and not sys.stdin.isatty():
        raise UsageError(f"not deleting endpoint {args.name} without --yes (no terminal to ask for confirmation)")
    endpoint = endpoint_find(client, args.name)
    live = len(endpoint["replicas"])
    if not args.yes and not _confirm(f"delete endpoint {args.name} and drain its {live} live replica(s)?"):
        err(f"endpoint {args.name} not deleted")
        return EXIT_USAGE
    try:
        client.endpoint_delete(endpoint["id"])
    except ApiError as exc:
        if exc.status != 404:  # 404: a retried DELETE whose first answer was lost; it is gone either way
            raise
    print(f"endpoint {args.name} deleted; its {live} live replica(s) drain and stop")
    return 0


# --- logs ------------------------------------------------------------------------------


class ReplicaLines:
    """A replica's log, written out in whole lines, each prefixed with ``[replica <id>]``
    while ``prefixed()`` says more than one replica is being printed (so lines never interleave)."""

    def __init__(self, replica_id: int, prefixed: Callable[[], bool], out=None):
        self.prefix = f"[replica {replica_id}] "
        self.prefixed = prefixed
        self.out = out or sys.stdout
        self.pending = ""

    def write(self, text: str) -> None:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.out.write(f"{self.prefix if self.prefixed() else ''}{line}\n")

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        """Write out a last line without a newline (given one when prefixed, so the next prefix starts a line)."""
        if self.pending:
            self.out.write(f"{self.prefix}{self.pending}\n" if self.prefixed() else self.pending)
            self.pending = ""
        self.out.flush()


def cmd_logs(client: Client, args) -> int:
    endpoint = endpoint_find(client, args.name)
    replicas = endpoint["replicas"]
    if args.replica is not None:
        replicas = [r for r in replicas if r["id"] == args.replica]
        if not replicas:
            raise ApiError(f"endpoint {args.name} has no live replica {args.replica}", status=404, code="not_found")
    if not replicas:
        scales = " (it scales from zero: its first request starts one)" if endpoint["min_replicas"] == 0 else ""
        err(f"endpoint {args.name} has no live replicas{scales}")
        return 0
    followers: dict[int, tuple[LogFollower, ReplicaLines]] = {}

    def follow(replica: dict) -> None:
        lines = ReplicaLines(replica["id"], lambda: len(followers) > 1)
        followers[replica["id"]] = (LogFollower(client, replica["job"], out=lines), lines)

    for replica in replicas:
        follow(replica)
    interval = poll_interval()
    try:
        while True:
            for log, _ in followers.values():
                while not log.complete and log.poll():
                    pass
            if not args.follow:
                return 0
            if args.replica is None:  # replicas come and go as the endpoint scales: follow new ones too
                new = [r for r in _live_replicas(client, endpoint["id"]) if r["id"] not in followers]
                for replica in new:
                    follow(replica)
                if new:
                    continue
            if all(log.complete for log, _ in followers.values()):
                return 0
            time.sleep(interval)
    finally:
        for _, lines in followers.values():
            lines.close()


def _live_replicas(client: Client, endpoint_id: int) -> list[dict]:
    try:
        return client.endpoint(endpoint_id)["replicas"]
    except ApiError as exc:
        if exc.status == 404:  # deleted meanwhile: no new replicas; the ones followed drain and end
            return []
        raise


# --- argument parsing ------------------------------------------------------------------------


def endpoint_parser_add(sub) -> None:
    """``gpushare endpoint ...`` under the top-level subcommands."""
    endpoint = sub.add_parser(
        "endpoint",
        help="deploy and manage inference endpoints",
        description="Inference endpoints: model servers run as replicas on shared GPU slices behind the gateway.",
    )
    commands = endpoint.add_subparsers(dest="endpoint_cmd", required=True)

    p = commands.add_parser(
        "deploy",
        help="create an endpoint, or update the one of that name (a rolling update)",
        description="Create an endpoint, or change the one of that name: gpushare endpoint deploy NAME [flags] -- CMD "
        "ARGS. The fields given replace the endpoint's (--env replaces its whole env); the others keep their values.",
    )
    p.add_argument("name", help="the endpoint's name (letters, digits, - and _)")
    p.add_argument("-f", "--file", help="YAML (or JSON) file with the endpoint's fields; '-' reads stdin")
    p.add_argument(
        "--gpus", type=gpus_arg, help=f"slice per replica: 0.125, 0.25, 0.5 or 1-8 (new endpoint: {DEFAULT_GPUS})"
    )
    p.add_argument("--gpu-model")
    p.add_argument("--min", type=int, metavar="N", help="min replicas (0: scale to zero when idle)")
    p.add_argument("--max", type=int, metavar="N", help="max replicas")
    p.add_argument("--concurrency", type=int, metavar="N", help="in-flight requests per replica before another starts")
    p.add_argument("--idle-timeout", type=int, metavar="S", help="seconds without a request before scaling down")
    p.add_argument("--health-path", metavar="P", help="the gateway sends traffic once this answers below 500")
    p.add_argument("--env", action="append", metavar="KEY=VALUE")
    p.add_argument("--image")
    p.add_argument("--priority")
    p.add_argument("--wait", action="store_true", help="wait until a replica of the new version is ready")
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds (exit 124)")
    p.add_argument("--json", action="store_true", help="print the endpoint as JSON")
    p.add_argument("command", nargs="*", help="what starts one replica, after '--'")
    p.set_defaults(func=cmd_deploy)

    p = commands.add_parser("list", help="the endpoints: version, replicas, bounds, slice, cost, URL")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = commands.add_parser("logs", help="print the log of each live replica")
    p.add_argument("name")
    p.add_argument("--replica", type=int, metavar="ID", help="only this replica")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing (new replicas too) until they end")
    p.set_defaults(func=cmd_logs)

    p = commands.add_parser("scale", help="set an endpoint's replica bounds")
    p.add_argument("name")
    p.add_argument("--min", type=int, metavar="N")
    p.add_argument("--max", type=int, metavar="N")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_scale)

    p = commands.add_parser("delete", help="delete an endpoint (its replicas drain and stop)")
    p.add_argument("name")
    p.add_argument("--yes", action="store_true", help="do not ask (required without a terminal)")
    p.set_defaults(func=cmd_delete)
