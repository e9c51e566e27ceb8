"""Job commands: submit, run, wait, logs, status, list, cancel."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import click

from ..client import JOB_FIELDS, JobWatch
from ..errors import WaitTimeout
from ..models import Finished, Job, LogText, Outage, Recovered, StateChanged
from .app import (
    EXIT_CANCELLED,
    EXIT_GAVE_UP,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
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

STATES = ["queued", "scheduled", "running", "succeeded", "failed", "cancelled", "preempted", "lost"]
# Command-line words go on as the command: `gpushare submit --gpus 1 python train.py --epochs 3`.
COMMAND_CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": False}


def job_exit_code(job: Job) -> int:
    """The exit code a job's end gives (the root command's help has the table)."""
    if job.state == "succeeded":
        return 0
    if job.state == "cancelled":
        return EXIT_CANCELLED
    if job.state in ("lost", "preempted"):
        return EXIT_GAVE_UP
    code = job.exit_code
    if code is None or code == 0:
        return 1
    if code < 0:
        return min(255, 128 - code)  # killed by signal -code
    return code if code <= 255 else 1


def queue_text(job: Job) -> str:
    parts = []
    if job.queue_position:
        parts.append(f"position {job.queue_position} in the queue")
    if job.estimated_start:
        parts.append(f"estimated start {job.estimated_start:%Y-%m-%d %H:%M:%S} UTC")
    if job.pending_reason and job.state == "queued":
        parts.append(job.pending_reason)
    if job.node and job.state in ("scheduled", "running"):
        parts.append(f"on {job.node}")
    return f" ({'; '.join(parts)})" if parts else ""


def end_text(job: Job) -> str:
    detail = f"exit code {job.exit_code}" if job.exit_code is not None else job.stop_reason
    return f"job {job.id} {job.state}" + (f": {detail}" if detail else "") + f" (cost {dollars(job.cost)})"


# --- the job's fields from the command line ---------------------------------------------------


def job_options(func: Callable) -> Callable:
    for option in reversed(
        [
            click.option("-f", "--file", help="YAML (or JSON) file with the job's fields; '-' reads stdin."),
            click.option("--name", help="A name to find the job by (at most 200 characters)."),
            click.option("--kind", type=click.Choice(["training", "inference"]), help="Default: by --gpus."),
            click.option("--gpus", type=GPUS, help="1-8 whole GPUs, or a slice of one: 0.125, 0.25, 0.5 (inference)."),
            click.option("--image", help="Container image (the docker runtime)."),
            click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="An environment variable; repeat."),
            click.option("--gpu-model", help="Only this GPU model (H100-80GB, ...)."),
            click.option("--gpu-memory-mb", type=click.IntRange(1), help="GPU memory the job needs."),
            click.option("--priority", help="A priority class (default: by kind)."),
            click.option("--max-runtime-seconds", type=click.IntRange(1), help="Stopped after this long."),
            click.option(
                "--idempotency-key",
                envvar="GPUSHARE_IDEMPOTENCY_KEY",
                help="Default: $GPUSHARE_IDEMPOTENCY_KEY, else a fresh UUID. The same key finds the same job.",
            ),
        ]
    ):
        func = option(func)
    return func


def job_body(
    *,
    file=None,
    name=None,
    kind=None,
    gpus=None,
    image=None,
    env=(),
    gpu_model=None,
    gpu_memory_mb=None,
    priority=None,
    max_runtime_seconds=None,
    command=(),
    **_,
) -> dict:
    """The request body: the -f file, then the flags over it."""
    body: dict = fields_load(file, JOB_FIELDS, "job") if file else {}
    flags = {
        "name": name,
        "kind": kind,
        "gpus": gpus,
        "image": image,
        "gpu_model": gpu_model,
        "gpu_memory_mb": gpu_memory_mb,
        "priority": priority,
        "max_runtime_seconds": max_runtime_seconds,
    }
    body.update({k: v for k, v in flags.items() if v is not None})
    if env:
        body["env"] = env_merge(body.get("env"), env)
    if command:
        body["command"] = list(command)
    body.setdefault("gpus", 1)
    if "gpus" in body and file:
        body["gpus"] = GPUS.convert(body["gpus"], None, None)
    whole = float(body["gpus"]).is_integer()
    body.setdefault("kind", "training" if whole else "inference")
    if body["kind"] == "training" and not whole:
        raise UsageError(f"a training job takes whole GPUs (1-8); a slice of {body['gpus']} is --kind inference")
    if not body.get("command"):
        raise UsageError("no command: put it after the options (gpushare submit -- python train.py) or in -f")
    return body


def _key(idempotency_key: str | None) -> str | None:
    return idempotency_key or os.environ.get("GPUSHARE_IDEMPOTENCY_KEY") or None


# --- following a job ------------------------------------------------------------------------


def follow(
    watch: JobWatch,
    *,
    timeout: float | None,
    quiet: bool,
    log_out=None,
    cancel_on_timeout: bool = False,
) -> int:
    """Print what ``watch`` sees (state changes on stderr, the log to ``log_out``) until the job
    ends, and return its exit code; EXIT_TIMEOUT when ``timeout`` passes first."""
    log_out = log_out or sys.stdout
    first = True
    try:
        for event in watch.events(timeout=timeout):
            if isinstance(event, LogText):
                log_out.write(event.text)
                log_out.flush()
            elif isinstance(event, StateChanged):
                if not quiet and not (first and event.job.finished):
                    err(f"job {event.job.id}: {event.job.state}{queue_text(event.job)}")
                first = False
            elif isinstance(event, Outage):
                if not quiet:
                    err(f"platform unreachable, still waiting: {event.error}")
            elif isinstance(event, Recovered):
                if not quiet:
                    err("the platform answers again")
            elif isinstance(event, Finished):
                if state().json:
                    out_json(event.job.raw)
                if not quiet:
                    err(end_text(event.job))
                return job_exit_code(event.job)
    except WaitTimeout as exc:
        err(f"job {exc.job.id} still {exc.job.state} after --timeout {timeout:g}s")
        if cancel_on_timeout:
            state().client().cancel(exc.job.id)
            err(f"job {exc.job.id}: cancel requested")
        return EXIT_TIMEOUT
    raise AssertionError("watch ends with Finished")  # pragma: no cover


def waiting_options(func: Callable) -> Callable:
    func = click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")(func)
    func = click.option("--cancel-on-timeout", is_flag=True, help="Cancel the job when --timeout passes.")(func)
    func = click.option("--logs", is_flag=True, help="Stream the job's log while waiting (stderr with -o json).")(func)
    return click.option(
        "--timeout", type=click.FloatRange(min=0, min_open=True), help="Give up waiting after this many seconds (124)."
    )(func)


def _watch(job_id: int, *, logs: bool, wake: threading.Event | None = None, tick=None) -> JobWatch:
    return JobWatch(
        state().client(),
        job_id,
        logs=logs,
        poll_interval=poll_interval(),
        outage_patience=outage_patience(),
        wake=wake,
        tick=tick,
    )


# --- submit -------------------------------------------------------------------------------------


@gpushare.command(context_settings=COMMAND_CONTEXT, short_help="Submit a job (or a job array).")
@job_options
@click.option("--array", metavar="SPEC", help="A job array: a task count (10) or task indexes (1-1000, 1-99:2).")
@click.option("--wait", is_flag=True, help="Wait for the job and exit with its exit code.")
@waiting_options
@output_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def submit(array, wait, timeout, logs, cancel_on_timeout, quiet, idempotency_key, **fields) -> int:
    """Submit a job: gpushare submit [OPTIONS] [--] COMMAND [ARGS]...

    Prints the job (its id alone with -q, the API's object with -o json). With --wait,
    follows it and exits with its exit code.
    """
    body = job_body(**fields)
    client = state().client()
    submitted = client.submit(body=body, array=array, idempotency_key=_key(idempotency_key))
    verb = "submitted" if submitted.created else "already submitted (same Idempotency-Key)"
    if submitted.array is not None:
        group = submitted.array
        if wait:
            raise UsageError("--wait follows one job; an array's tasks are listed by gpushare list --array ID")
        if state().json:
            out_json(submitted.raw)
        elif quiet:  # the tasks' job ids, one per line (what `gpushare wait` and `cancel` take)
            for job_id in sorted(j.id for j in client.jobs(array=group.id, page_size=500)):
                out(str(job_id))
        else:
            out(f"job array {group.id} {verb}: {group.task_count} tasks (gpushare list --array {group.id})")
        return 0
    jobs = [submitted.job]
    if state().json:
        if not wait:  # with --wait, the finished job is the result
            out_json(submitted.raw)
    elif quiet:
        out(str(jobs[0].id))
    else:
        (err if wait else out)(f"job {jobs[0].id} {verb}: {jobs[0].state}{queue_text(jobs[0])}")
    if not wait:
        return 0
    log_out = sys.stderr if state().json else sys.stdout
    return follow(
        _watch(jobs[0].id, logs=logs),
        timeout=timeout,
        quiet=quiet,
        log_out=log_out,
        cancel_on_timeout=cancel_on_timeout,
    )


# --- run: submit, stream, forward Ctrl-C ------------------------------------------------------------


class Interrupts:
    """SIGINT while ``run`` follows a job: the first asks for a cancel (and wakes the poll),
    the second detaches (KeyboardInterrupt) and leaves the job as it is."""

    def __init__(self):
        self.count = 0
        self.wake = threading.Event()
        self.previous = None

    def __enter__(self) -> Interrupts:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous or signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count >= 2:
            raise KeyboardInterrupt
        self.wake.set()


@gpushare.command(context_settings=COMMAND_CONTEXT, short_help="Run a command on GPUs and stream its output.")
@job_options
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Cancel the job after this long (124).")
@click.option("-q", "--quiet", is_flag=True, help="Only the job's output: no progress lines on stderr.")
@output_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(timeout, quiet, idempotency_key, **fields) -> int:
    """Run a command on GPUs and stream its output: gpushare run [--gpus N] [--image I] -- COMMAND...

    Submits the job, prints its output as it comes and exits with its exit code,
    like srun. Ctrl-C cancels the job (and waits for it to stop); a second Ctrl-C
    detaches, leaving the job as it is. With -o json the output goes to stderr and
    the finished job to stdout.
    """
    body = job_body(**fields)
    client = state().client()
    job = client.submit(body=body, idempotency_key=_key(idempotency_key)).job
    if not quiet:
        err(f"job {job.id} submitted: {job.state}{queue_text(job)} (Ctrl-C cancels it)")
    log_out = sys.stderr if state().json else sys.stdout
    cancelled = []

    def cancel_once() -> None:
        if interrupts.count and not cancelled:
            cancelled.append(client.cancel(job.id))
            err(f"job {job.id}: cancel requested; Ctrl-C again to detach")

    with Interrupts() as interrupts:
        try:
            return follow(
                _watch(job.id, logs=True, wake=interrupts.wake, tick=cancel_once),
                timeout=timeout,
                quiet=quiet,
                log_out=log_out,
                cancel_on_timeout=True,
            )
        except KeyboardInterrupt:
            err(f"detached: job {job.id} goes on as it is (gpushare logs -f {job.id}; gpushare cancel {job.id})")
            return EXIT_INTERRUPTED


# --- wait, logs, status, list, cancel -------------------------------------------------------------


@gpushare.command()
@click.argument("job_id", metavar="JOB", type=int)
@waiting_options
@output_options
def wait(job_id, timeout, logs, cancel_on_timeout, quiet) -> int:
    """Wait for a job and exit with its exit code."""
    log_out = sys.stderr if state().json else sys.stdout
    return follow(
        _watch(job_id, logs=logs), timeout=timeout, quiet=quiet, log_out=log_out, cancel_on_timeout=cancel_on_timeout
    )


@gpushare.command()
@click.argument("job_id", metavar="JOB", type=int)
@click.option("-f", "--follow", "keep", is_flag=True, help="Keep printing until the job ends.")
@click.option("--offset", type=click.IntRange(0), default=0, help="Start at this byte offset.")
def logs(job_id, keep, offset) -> int:
    """Print a job's log."""
    for text in state().client().stream_logs(job_id, offset=offset, follow=keep, poll_interval=poll_interval()):
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


@gpushare.command()
@click.argument("job_id", metavar="JOB", type=int)
@output_options
def status(job_id) -> int:
    """Show a job."""
    job = state().client().job(job_id)
    started = f"{job.started_at:%Y-%m-%d %H:%M:%S}" if job.started_at else "-"
    finished = f"{job.finished_at:%Y-%m-%d %H:%M:%S}" if job.finished_at else "-"
    emit(
        job.raw,
        [
            f"job {job.id} {job.name}".rstrip(),
            f"  state      {job.state}{queue_text(job)}",
            f"  kind       {job.kind}, {job.gpus} GPU ({job.mode}, isolation {job.isolation or '-'})",
            f"  gpus       {', '.join(job.gpu_uuids) or '-'}",
            f"  submitted  {job.submitted_at:%Y-%m-%d %H:%M:%S} UTC" if job.submitted_at else "  submitted  -",
            f"  started    {started}   finished {finished}",
            f"  exit code  {job.exit_code if job.exit_code is not None else '-'}",
            f"  cost       {dollars(job.cost)}   gpu-seconds {job.usage.gpu_seconds}",
        ],
    )
    return 0


@gpushare.command(name="list")
@click.option("--state", "states", multiple=True, type=click.Choice(STATES), help="Only this state; repeat.")
@click.option("--kind", type=click.Choice(["training", "inference"]))
@click.option("--name", help="Jobs whose name contains this.")
@click.option("--array", "array_id", type=int, metavar="ID", help="Only the tasks of this job array.")
@click.option("--limit", type=click.IntRange(1), default=20, show_default=True, help="At most this many (newest).")
@output_options
def list_jobs(states, kind, name, array_id, limit) -> int:
    """List jobs, newest first."""
    jobs = list(
        state()
        .client()
        .jobs(state=list(states) or None, kind=kind, name=name, array=array_id, page_size=min(limit, 500), limit=limit)
    )
    if state().json:
        out_json({"results": [j.raw for j in jobs]})
        return 0
    rows = [
        (j.id, j.state, j.kind, j.gpus, f"{j.submitted_at:%Y-%m-%d %H:%M:%S}" if j.submitted_at else "", j.name)
        for j in jobs
    ]
    for line in table(("ID", "STATE", "KIND", "GPUS", "SUBMITTED", "NAME"), rows, right=(0, 3)):
        out(line)
    return 0


@gpushare.command()
@click.argument("job_ids", metavar="JOB...", type=int, nargs=-1, required=True)
@output_options
def cancel(job_ids) -> int:
    """Cancel jobs (a queued job at once, a running one gracefully)."""
    client = state().client()
    jobs = [client.cancel(job_id) for job_id in job_ids]
    emit(
        jobs[0].raw if len(jobs) == 1 else [j.raw for j in jobs],
        [f"job {j.id}: {j.state}{'' if j.finished else ' (stopping)'}" for j in jobs],
    )
    return 0
