"""``gpushare endpoint deploy|list|logs|scale|delete``: inference endpoints by name.

The commands find an endpoint by its name (``GET /api/v1/endpoints/?name=``, an
exact match within the token's tenant); an unknown name exits 125 like any other
refusal. ``deploy`` is declarative: it creates the endpoint, or, when one of that
name exists, changes the fields given (a change of what replicas run is a rolling
update to a new version). A replica is a job, so its log is the job's log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import click

from ..client import Client
from ..errors import ApiError, Conflict, NotFound
from ..models import Endpoint
from .app import (
    EXIT_TIMEOUT,
    EXIT_USAGE,
    GPUS,
    UsageError,
    dollars,
    emit,
    env_merge,
    err,
    fields_load,
    gpushare,
    out,
    out_json,
    outage_patience,
    output_options,
    poll_interval,
    state,
    table,
)

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
DEFAULT_GPUS = 0.25  # a new endpoint's slice when neither --gpus nor the file says


def endpoint_find(client: Client, name: str) -> Endpoint:
    found = client.endpoints(name=name)
    if not found:
        raise NotFound(f"no endpoint named {name}", status=404, code="not_found")
    return found[0]


def _summary(endpoint: Endpoint) -> list[str]:
    replicas = f"{endpoint.ready} ready / {len(endpoint.replicas)} live"
    return [
        f"  url       {endpoint.url}  (on the gateway)",
        f"  state     {endpoint.state}, version {endpoint.version}",
        f"  replicas  {replicas} (min {endpoint.min_replicas}, max {endpoint.max_replicas})",
    ]


@gpushare.group(short_help="Deploy and manage inference endpoints.")
def endpoint() -> None:
    """Inference endpoints: model servers run as replicas on shared GPU slices behind the gateway."""


# --- deploy ---------------------------------------------------------------------------


@endpoint.command(short_help="Create or update (roll out) an endpoint.")
@click.argument("name")
@click.option("-f", "--file", help="YAML (or JSON) file with the endpoint's fields; '-' reads stdin.")
@click.option("--gpus", type=GPUS, help=f"Slice per replica: 0.125, 0.25, 0.5 or 1-8 (new endpoint: {DEFAULT_GPUS}).")
@click.option("--gpu-model", help="Only this GPU model.")
@click.option("--min", "min_replicas", type=click.IntRange(0), metavar="N", help="Min replicas (0: scale to zero).")
@click.option("--max", "max_replicas", type=click.IntRange(1), metavar="N", help="Max replicas.")
@click.option("--concurrency", "concurrency_target", type=click.IntRange(1), metavar="N", help="In flight per replica.")
@click.option("--idle-timeout", "idle_timeout_seconds", type=click.IntRange(1), metavar="S", help="Idle before down.")
@click.option("--health-path", metavar="P", help="Traffic goes to a replica once this answers below 500.")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Replaces the endpoint's whole env.")
@click.option("--image")
@click.option("--priority")
@click.option("--wait", is_flag=True, help="Wait until a replica of the new version is ready.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="With --wait: give up after this (124).")
@output_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def deploy(name, file, env, wait, timeout, command, **flags) -> int:
    """Create an endpoint, or change the one of that name (a rolling update).

    gpushare endpoint deploy NAME [OPTIONS] -- COMMAND... (the command after '--').
    The fields given replace the endpoint's; the others keep their values.
    """
    body = fields_load(file, ENDPOINT_FIELDS, "endpoint") if file else {}
    named = body.pop("name", name)
    if named != name:
        raise UsageError(f"{file} names the endpoint {named!r}, the command line {name!r}")
    body.update({k: v for k, v in flags.items() if v is not None})
    if env:
        body["env"] = env_merge(body.get("env"), env)
    if command:
        body["command"] = list(command)
    client = state().client()
    before = next(iter(client.endpoints(name=name)), None)
    created = None
    if before is None:
        if not body.get("command"):
            raise UsageError(
                f"no command: put it after the options (gpushare endpoint deploy {name} -- serve) or in -f"
            )
        try:
            created = client.endpoint_create({"name": name, "gpus": DEFAULT_GPUS, **body})
        except Conflict:
            # Created meanwhile: a retried POST whose first answer was lost, or a concurrent deploy.
            before = endpoint_find(client, name)
    current = created or client.endpoint_update(before.id, body)
    if created is not None:
        verb = f"created (version {current.version})"
    elif current.version != before.version:
        verb = (
            f"updated: rolling out version {current.version} "
            f"(replicas of version {before.version} drain once it serves)"
        )
    else:
        verb = f"updated (still version {current.version}: nothing that replicas run changed)"
    if not state().json:
        for line in [f"endpoint {current.name} {verb}", *_summary(current)]:
            out(line)
    code = wait_ready(client, current, timeout=timeout) if wait else 0
    if state().json:
        out_json((client.endpoint(current.id) if wait else current).raw)
    return code


def _ready_replica(endpoint: Endpoint):
    """A ready replica of the endpoint's current version (an older version's does not count)."""
    return next((r for r in endpoint.replicas if r.state == "ready" and r.version == endpoint.version), None)


def wait_ready(client: Client, endpoint: Endpoint, *, timeout: float | None) -> int:
    """Poll until a replica of the current version is ready: 0, or EXIT_TIMEOUT after ``timeout`` seconds.

    An endpoint with min_replicas 0 starts no replica until its first request,
    so there is nothing to wait for. Platform outages are waited out as for jobs.
    """
    name = endpoint.name
    deadline = time.monotonic() + timeout if timeout else None
    seen = outage_since = None
    while True:
        replica = _ready_replica(endpoint)
        if replica is not None:
            err(f"endpoint {name}: replica {replica.id} of version {endpoint.version} is ready")
            return 0
        if endpoint.min_replicas == 0:
            err(f"endpoint {name} scales from zero: its first request starts a replica (min 0, nothing to wait for)")
            return 0
        states = sorted(r.state for r in endpoint.replicas if r.version == endpoint.version)
        if states != seen:
            err(f"endpoint {name} version {endpoint.version}: replicas {', '.join(states) or 'none yet'}")
            seen = states
        if deadline is not None and time.monotonic() > deadline:
            err(f"endpoint {name}: no replica of version {endpoint.version} ready after --timeout {timeout:g}s")
            return EXIT_TIMEOUT
        time.sleep(poll_interval())
        try:
            endpoint = client.endpoint(endpoint.id)
        except ApiError as exc:
            if not exc.transient:
                raise
            outage_since = outage_since or time.monotonic()
            if time.monotonic() - outage_since > outage_patience():
                raise
            err(f"platform unreachable, still waiting: {exc}")
            continue
        outage_since = None


# --- list, scale, delete -----------------------------------------------------------------


@endpoint.command(name="list")
@output_options
def list_endpoints() -> int:
    """The endpoints: version, replicas, bounds, slice, cost, URL."""
    endpoints = state().client().endpoints()
    rows = [
        (
            e.name,
            e.version,
            f"{e.ready}/{len(e.replicas)}",
            f"{e.min_replicas}-{e.max_replicas}",
            e.gpus,
            dollars(e.cost),
            e.url,
        )
        for e in endpoints
    ]
    emit([e.raw for e in endpoints], table(("NAME", "VERSION", "READY/LIVE", "MIN-MAX", "GPUS", "COST", "URL"), rows))
    return 0


@endpoint.command()
@click.argument("name")
@click.option("--min", "low", type=click.IntRange(0), metavar="N")
@click.option("--max", "high", type=click.IntRange(1), metavar="N")
@output_options
def scale(name, low, high) -> int:
    """Set an endpoint's replica bounds (a bound not given keeps its value)."""
    if low is None and high is None:
        raise UsageError("scale needs --min, --max or both")
    client = state().client()
    found = endpoint_find(client, name)
    was = f"{found.min_replicas}-{found.max_replicas}"
    low = found.min_replicas if low is None else low
    high = found.max_replicas if high is None else high
    done = client.endpoint_scale(found.id, min_replicas=low, max_replicas=high)
    emit(done.raw, [f"endpoint {done.name}: min {done.min_replicas}, max {done.max_replicas} (was {was})"])
    return 0


def _confirm(question: str) -> bool:
    click.echo(f"{question} [y/N] ", err=True, nl=False)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


@endpoint.command()
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask (required without a terminal).")
def delete(name, yes) -> int:
    """Delete an endpoint (its replicas drain and stop)."""
    if not yes and not sys.stdin.isatty():
        raise UsageError(f"not deleting endpoint {name} without --yes (no terminal to ask for confirmation)")
    client = state().client()
    found = endpoint_find(client, name)
    live = len(found.replicas)
    if not yes and not _confirm(f"delete endpoint {name} and drain its {live} live replica(s)?"):
        err(f"endpoint {name} not deleted")
        return EXIT_USAGE
    try:
        client.endpoint_delete(found.id)
    except NotFound:
        pass  # a retried DELETE whose first answer was lost: it is gone either way
    out(f"endpoint {name} deleted; its {live} live replica(s) drain and stop")
    return 0


# --- logs ---------------------------------------------------------------------------------


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
        self.out.flush()

    def close(self) -> None:
        """Write out a last line without a newline (given one when prefixed, so the next prefix starts a line)."""
        if self.pending:
            self.out.write(f"{self.prefix}{self.pending}\n" if self.prefixed() else self.pending)
            self.pending = ""
        self.out.flush()


class ReplicaLog:
    def __init__(self, client: Client, job_id: int, lines: ReplicaLines):
        self.client, self.job_id, self.lines = client, job_id, lines
        self.offset = 0
        self.complete = False

    def poll(self) -> bool:
        page = self.client.logs(self.job_id, offset=self.offset)
        if page.data:
            self.lines.write(page.data)
        moved = page.next_offset != self.offset
        self.offset, self.complete = page.next_offset, page.complete
        return moved


@endpoint.command()
@click.argument("name")
@click.option("--replica", "replica_id", type=int, metavar="ID", help="Only this replica.")
@click.option("-f", "--follow", "keep", is_flag=True, help="Keep printing (new replicas too) until they end.")
def logs(name, replica_id, keep) -> int:
    """Print the log of each live replica."""
    client = state().client()
    found = endpoint_find(client, name)
    replicas = list(found.replicas)
    if replica_id is not None:
        replicas = [r for r in replicas if r.id == replica_id]
        if not replicas:
            raise NotFound(f"endpoint {name} has no live replica {replica_id}", status=404, code="not_found")
    if not replicas:
        scales = " (it scales from zero: its first request starts one)" if found.min_replicas == 0 else ""
        err(f"endpoint {name} has no live replicas{scales}")
        return 0
    followers: dict[int, ReplicaLog] = {}

    def follow(replica) -> None:
        followers[replica.id] = ReplicaLog(client, replica.job, ReplicaLines(replica.id, lambda: len(followers) > 1))

    for replica in replicas:
        follow(replica)
    try:
        while True:
            for log in followers.values():
                while not log.complete and log.poll():
                    pass
            if not keep:
                return 0
            if replica_id is None:  # replicas come and go as the endpoint scales: follow new ones too
                new = [r for r in _live_replicas(client, found.id) if r.id not in followers]
                for replica in new:
                    follow(replica)
                if new:
                    continue
            if all(log.complete for log in followers.values()):
                return 0
            time.sleep(poll_interval())
    finally:
        for log in followers.values():
            log.lines.close()


def _live_replicas(client: Client, endpoint_id: int):
    try:
        return client.endpoint(endpoint_id).replicas
    except NotFound:  # deleted meanwhile: no new replicas; the ones followed drain and end
        return ()
