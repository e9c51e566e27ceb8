"""``gpushare`` command line. Exit codes (stable; CI scripts may rely on them):

====  ==========================================================================
0     success (for ``submit --wait`` / ``wait``: the job succeeded)
N     ``submit --wait`` / ``wait``: the job failed with exit code N (1-255; a job
      killed by signal S gives 128+S, a failure without an exit code gives 1)
2     bad command line or configuration; ``endpoint delete`` not confirmed
120   the job was cancelled
121   the job was lost, or preempted and not requeued (the platform gave up)
124   ``--timeout`` passed before the job ended (the job keeps running; cancel it
      with ``gpushare cancel`` or pass ``--cancel-on-timeout``), or, for
      ``endpoint deploy --wait``, before a replica of the new version was ready
125   the platform refused the request (4xx) or could not be reached after retries
====  ==========================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

from .client import ApiError, Client
from .common import (
    EXIT_API,
    EXIT_CANCELLED,
    EXIT_GAVE_UP,
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
from .config import ConfigError, config_load
from .endpoints import endpoint_parser_add

# The exit codes live in common.py; tests and scripts import them from here.
__all__ = ["EXIT_API", "EXIT_CANCELLED", "EXIT_GAVE_UP", "EXIT_TIMEOUT", "EXIT_USAGE", "job_exit_code", "main"]

FINAL_STATES = {"succeeded", "failed", "cancelled", "lost"}
PREEMPTED_PATIENCE_S = 120.0
BODY_FIELDS = (
    "name",
    "kind",
    "gpus",
    "command",
    "image",
    "env",
    "gpu_model",
    "gpu_memory_mb",
    "priority",
    "max_runtime_seconds",
)


# --- submit -----------------------------------------------------------------


def job_body(args) -> dict:
    """The request body: the -f file, then the flags over it."""
    body: dict = fields_load(args.file, BODY_FIELDS, "job") if args.file else {}
    for name in ("name", "kind", "gpus", "image", "gpu_model", "gpu_memory_mb", "priority", "max_runtime_seconds"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    if args.env:
        body["env"] = env_merge(body.get("env"), args.env)
    command = command_arg(args.command)
    if command:
        body["command"] = command
    if "kind" not in body:
        body["kind"] = "inference" if isinstance(body.get("gpus"), float) else "training"
    if "gpus" not in body:
        body["gpus"] = 1
    if not body.get("command"):
        raise UsageError("no command: put it after '--' (gpushare submit -- python train.py) or in the job file")
    return body


def cmd_submit(client: Client, args) -> int:
    body = job_body(args)
    key = args.idempotency_key or os.environ.get("GPUSHARE_IDEMPOTENCY_KEY") or f"cli-{uuid.uuid4()}"
    job, created = client.job_submit(body, idempotency_key=key)
    if args.json and not args.wait:
        print(json.dumps(job))
    elif not args.quiet:
        verb = "submitted" if created else "already submitted (same Idempotency-Key)"
        err(f"job {job['id']} {verb}: {job['state']}" + _queue_text(job))
        if not args.json:
            print(job["id"])
    if not args.wait:
        return 0
    return wait_for_job(
        client,
        job,
        timeout=args.timeout,
        follow=args.logs,
        quiet=args.quiet,
        cancel_on_timeout=args.cancel_on_timeout,
        as_json=args.json,
    )


# --- waiting and logs ---------------------------------------------------------


def _queue_text(job: dict) -> str:
    parts = []
    if job.get("queue_position"):
        parts.append(f"position {job['queue_position']} in the queue")
    if job.get("estimated_start"):
        parts.append(f"estimated start {job['estimated_start']}")
    if job.get("pending_reason") and job.get("state") == "queued":
        parts.append(job["pending_reason"])
    if job.get("node") and job.get("state") in ("scheduled", "running"):
        parts.append(f"on {job['node']}")
    return f" ({'; '.join(parts)})" if parts else ""


def job_exit_code(job: dict) -> int:
    state = job["state"]
    if state == "succeeded":
        return 0
    if state == "cancelled":
        return EXIT_CANCELLED
    if state in ("lost", "preempted"):
        return EXIT_GAVE_UP
    code = job.get("exit_code")
    if code is None or code == 0:
        return 1
    if code < 0:
        return min(255, 128 - code)  # killed by signal -code
    return code if code <= 255 else 1


def wait_for_job(
    client: Client,
    job: dict,
    *,
    timeout: float | None,
    follow: bool = False,
    quiet: bool = False,
    cancel_on_timeout: bool = False,
    as_json: bool = False,
) -> int:
    """Poll until the job ends and return its exit code (see the module doc).

    A platform outage that outlasts the client's own retries is waited out for up
    to GPUSHARE_OUTAGE_PATIENCE seconds (default 900): the job runs on regardless.
    """
    deadline = time.monotonic() + timeout if timeout else None
    interval = poll_interval()
    logs = LogFollower(client, job["id"]) if follow else None
    seen = (job["state"], job.get("queue_position"))
    preempted_since = outage_since = None
    while True:
        if job["state"] in FINAL_STATES:
            if logs is None or logs.complete:
                break
        elif job["state"] == "preempted":
            preempted_since = preempted_since or time.monotonic()
            if time.monotonic() - preempted_since > PREEMPTED_PATIENCE_S:
                break
        else:
            preempted_since = None
        if deadline is not None and time.monotonic() > deadline:
            err(f"job {job['id']} still {job['state']} after --timeout {timeout:g}s")
            if cancel_on_timeout:
                client.job_cancel(job["id"])
                err(f"job {job['id']}: cancel requested")
            return EXIT_TIMEOUT
        time.sleep(interval)
        try:
            if logs is not None:
                while logs.poll():
                    pass
            job = client.job(job["id"])
        except ApiError as exc:
            if not transient(exc):
                raise
            outage_since = outage_since or time.monotonic()
            if time.monotonic() - outage_since > outage_patience():
                raise
            if not quiet:
                err(f"platform unreachable, still waiting: {exc}")
            continue
        if outage_since is not None and not quiet:
            err("the platform answers again")
        outage_since = None
        now = (job["state"], job.get("queue_position"))
        if now != seen and not quiet:
            err(f"job {job['id']}: {job['state']}" + _queue_text(job))
        seen = now
    code = job_exit_code(job)
    if as_json:
        print(json.dumps(job))
    if not quiet:
        detail = f"exit code {job['exit_code']}" if job.get("exit_code") is not None else job.get("stop_reason") or ""
        err(f"job {job['id']} {job['state']}" + (f": {detail}" if detail else "") + f" (cost {job['cost']})")
    return code


def cmd_wait(client: Client, args) -> int:
    return wait_for_job(
        client,
        client.job(args.job),
        timeout=args.timeout,
        follow=args.logs,
        quiet=args.quiet,
        cancel_on_timeout=args.cancel_on_timeout,
        as_json=args.json,
    )


def cmd_logs(client: Client, args) -> int:
    logs = LogFollower(client, args.job, offset=args.offset)
    interval = poll_interval()
    while True:
        while logs.poll():
            pass
        if not args.follow or logs.complete:
            return 0
        time.sleep(interval)


# --- the rest -------------------------------------------------------------------


def cmd_status(client: Client, args) -> int:
    job = client.job(args.job)
    print_out(
        job,
        args.json,
        [
            f"job {job['id']} {job['name'] or ''}".rstrip(),
            f"  state      {job['state']}{_queue_text(job)}",
            f"  kind       {job['kind']} x{job['gpus']} ({job['mode']}, isolation {job['isolation'] or '-'})",
            f"  gpus       {', '.join(job['gpu_uuids']) or '-'}",
            f"  submitted  {job['submitted_at']}",
            f"  started    {job['started_at'] or '-'}   finished {job['finished_at'] or '-'}",
            f"  exit code  {job['exit_code'] if job['exit_code'] is not None else '-'}",
            f"  cost       {job['cost']}   gpu-seconds {job['usage']['gpu_seconds']}",
        ],
    )
    return 0


def cmd_list(client: Client, args) -> int:
    params = {"state": args.state, "kind": args.kind, "name": args.name, "page_size": args.limit}
    page = client.get("jobs/", **params)
    rows = [
        f"{j['id']:>8}  {j['state']:<10} {j['kind']:<9} {str(j['gpus']):>5}  {j['submitted_at'][:19]}  {j['name']}"
        for j in page["results"]
    ]
    header = f"{'ID':>8}  {'STATE':<10} {'KIND':<9} {'GPUS':>5}  {'SUBMITTED':<19}  NAME"
    more = ", more: raise --limit or filter" if page.get("next") else ""  # the job list pages by cursor (no count)
    print_out(page, args.json, [header, *rows, f"({len(rows)} shown{more})"])
    return 0


def cmd_cancel(client: Client, args) -> int:
    job = client.job_cancel(args.job)
    note = "" if job["state"] == "cancelled" else " (stopping)"
    print_out(job, args.json, [f"job {job['id']}: {job['state']}{note}"])
    return 0


def cmd_usage(client: Client, args) -> int:
    now = datetime.now(UTC).replace(microsecond=0)
    start = args.start or now.replace(day=1, hour=0, minute=0, second=0).isoformat()
    end = args.end or (now + timedelta(seconds=1)).isoformat()
    print_out(client.get("usage/", start=start, end=end, group_by=args.group_by), args.json)
    return 0


def cmd_quota(client: Client, args) -> int:
    print_out(client.get("quota/"), args.json)
    return 0


def cmd_estimate(client: Client, args) -> int:
    params = {
        "kind": args.kind,
        "gpus": args.gpus,
        "max_runtime_seconds": args.max_runtime_seconds,
        "priority": args.priority,
        "gpu_model": args.gpu_model,
    }
    print_out(client.get("estimate/", **params), args.json)
    return 0


# --- argument parsing -------------------------------------------------------------


def parser_build() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpushare",
        description="Submit and follow GPU jobs, and deploy inference endpoints, on gpushare.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="platform address (default: $GPUSHARE_URL or the config file)")
    parser.add_argument("--token", help="API token (default: $GPUSHARE_TOKEN or the config file)")
    parser.add_argument("--retries", type=int, default=6, help="retries of a transient failure (default 6)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    def waiting(p):
        p.add_argument("--timeout", type=float, help="give up waiting after this many seconds (exit 124)")
        p.add_argument("--logs", action="store_true", help="stream the job's log to stdout while waiting")
        p.add_argument("--cancel-on-timeout", action="store_true", help="cancel the job when --timeout passes")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")

    p = sub.add_parser("submit", help="submit a job", description="Submit a job: gpushare submit [flags] -- CMD ARGS")
    p.add_argument("-f", "--file", help="YAML (or JSON) file with the job's fields; '-' reads stdin")
    p.add_argument("--name")
    p.add_argument("--kind", choices=["training", "inference"])
    p.add_argument("--gpus", type=gpus_arg, help="1-8 whole GPUs, or 0.125/0.25/0.5 of one (inference)")
    p.add_argument("--image")
    p.add_argument("--env", action="append", metavar="KEY=VALUE")
    p.add_argument("--gpu-model")
    p.add_argument("--gpu-memory-mb", type=int)
    p.add_argument("--priority")
    p.add_argument("--max-runtime-seconds", type=int)
    p.add_argument("--idempotency-key", help="default: $GPUSHARE_IDEMPOTENCY_KEY, else a fresh UUID")
    p.add_argument("--wait", action="store_true", help="wait for the job and exit with its exit code")
    p.add_argument("--json", action="store_true", help="print the job as JSON (at the end, with --wait)")
    waiting(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after '--'")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("wait", help="wait for a job and exit with its exit code")
    p.add_argument("job", type=int)
    p.add_argument("--json", action="store_true")
    waiting(p)
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("logs", help="print a job's log")
    p.add_argument("job", type=int)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--offset", type=int, default=0, help="start at this byte offset")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("status", help="show a job")
    p.add_argument("job", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("list", help="list jobs, newest first")
    p.add_argument(
        "--state", choices=["queued", "scheduled", "running", "succeeded", "failed", "cancelled", "preempted", "lost"]
    )
    p.add_argument("--kind", choices=["training", "inference"])
    p.add_argument("--name", help="jobs whose name contains this")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("usage", help="GPU-seconds and cost over a period")
    p.add_argument("--start", help="ISO 8601 date-time (default: the start of this month, UTC)")
    p.add_argument("--end", help="ISO 8601 date-time, exclusive (default: now)")
    p.add_argument("--group-by", choices=["day", "job", "gpu_model"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("quota", help="limits, current use and headroom, spend against budget")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_quota)

    p = sub.add_parser("estimate", help="what a job would cost")
    p.add_argument("--kind", choices=["training", "inference"], default="training")
    p.add_argument("--gpus", type=gpus_arg, default=1)
    p.add_argument("--max-runtime-seconds", type=int, default=3600)
    p.add_argument("--priority")
    p.add_argument("--gpu-model")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_estimate)

    endpoint_parser_add(sub)
    return parser


def args_parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``, with everything after the first ``--`` taken as the command.

    argparse cannot itself take a positional (``endpoint deploy NAME``) followed by
    a command that has flags of its own (``-- python serve.py --port 1``): it
    would give the command's flags to NAME's parser, or refuse them.
    """
    parser = parser_build()
    if "--" not in argv:
        return parser.parse_args(argv)
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    if not hasattr(args, "command"):
        parser.error("only 'submit' and 'endpoint deploy' take a command after '--'")
    args.command = [*command_arg(args.command), *argv[cut + 1 :]]
    return args


def main(argv: list[str] | None = None) -> int:
    args = args_parse(sys.argv[1:] if argv is None else list(argv))
    try:
        client = Client(config_load(url=args.url, token=args.token), retries=args.retries)
        return args.func(client, args)
    except (ConfigError, UsageError) as exc:
        err(str(exc))
        return EXIT_USAGE
    except ApiError as exc:
        err(f"{exc.code + ': ' if exc.code else ''}{exc}")
        return EXIT_API
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
