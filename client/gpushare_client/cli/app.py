"""The ``gpushare`` root command and what every subcommand shares: global options, the
output mode (human or JSON), exit codes, stderr messages and argument types."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import yaml

from .. import __version__
from ..client import Client
from ..errors import ConfigError

# Exit codes (stable; CI scripts may rely on them). docs/ci.md has the table.
EXIT_USAGE = 2
EXIT_CANCELLED = 120
EXIT_GAVE_UP = 121
EXIT_TIMEOUT = 124
EXIT_API = 125
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

EPILOG = """\b
Exit codes:
  0    success (submit --wait, wait, run: the job succeeded)
  N    the job failed with exit code N (killed by signal S: 128+S; no exit code: 1)
  2    bad command line or configuration; endpoint delete not confirmed
  120  the job was cancelled
  121  the job was lost, or preempted and not requeued (the platform gave up)
  124  --timeout passed before the job ended (it keeps running unless --cancel-on-timeout)
  125  the platform refused the request (4xx) or stayed unreachable
  130  interrupted (run: detached after a second Ctrl-C; the job keeps running)

\b
Configuration: --url/--token, else GPUSHARE_URL/GPUSHARE_TOKEN, else
~/.config/gpushare/config.toml (url = "...", token = "gps_...").
Shell completion: eval "$(gpushare completion bash)" (or zsh, fish)."""


class UsageError(click.UsageError):
    """A bad command line or input file: exit 2 (click's own usage errors exit 2 too)."""


@dataclass
class State:
    """What the root command's options leave for the subcommands."""

    url: str | None = None
    token: str | None = None
    retries: int = 6
    output: str = "human"
    _client: Client | None = field(default=None, repr=False)

    @property
    def json(self) -> bool:
        return self.output == "json"

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(url=self.url, token=self.token, retries=self.retries)
        return self._client


def state() -> State:
    return click.get_current_context().find_object(State)


# --- output -------------------------------------------------------------------------


def out(text: str = "") -> None:
    """A line of the command's result (stdout)."""
    click.echo(text)


def err(message: str) -> None:
    """A diagnostic or progress line (stderr)."""
    click.echo(f"gpushare: {message}", err=True)


def out_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str))


def dollars(value) -> str:
    """Money as the API gave it, exact, in plain digits: $0.0123456789 (never 0E-10)."""
    return "-" if value is None else f"${Decimal(str(value)):f}"


def emit(data: Any, lines: Sequence[str]) -> None:
    """The result: ``data`` as JSON with ``-o json``, else the human ``lines``."""
    if state().json:
        out_json(data)
    else:
        for line in lines:
            out(line)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> list[str]:
    """Aligned columns; ``right`` are the indexes of right-aligned (numeric) columns."""
    cells = [[str(c) for c in header], *[["-" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]


def _set_output(ctx: click.Context, param: click.Parameter, value) -> None:
    if value is None or value is False:
        return
    ctx.find_object(State).output = "json" if value is True else value


def output_options(func: Callable) -> Callable:
    """``-o human|json`` and ``--json`` on a command (the root command takes them too)."""
    func = click.option(
        "--json",
        is_flag=True,
        default=False,
        expose_value=False,
        callback=_set_output,
        help="Same as -o json.",
    )(func)
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["human", "json"]),
        default=None,
        expose_value=False,
        callback=_set_output,
        help="human (default) or json: the API's objects, for scripts.",
    )(func)


# --- argument types -------------------------------------------------------------------


SLICES = (0.125, 0.25, 0.5)


class GpusType(click.ParamType):
    """``--gpus``: 1-8 whole GPUs (an int, the API's shape) or a slice 0.125/0.25/0.5 (a float)."""

    name = "N"

    def convert(self, value, param, ctx):
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                number = float("nan")
        if number.is_integer() and 1 <= number <= 8:
            return int(number)
        if number in SLICES:
            return number
        self.fail(f"{value!s} is neither 1-8 whole GPUs nor a shared slice (0.125, 0.25 or 0.5 of one GPU)", param, ctx)


GPUS = GpusType()


def env_merge(env: dict | None, pairs: Sequence[str]) -> dict:
    """``env`` with each ``--env KEY=VALUE`` set over it."""
    merged = dict(env or {})
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env takes KEY=VALUE, got {pair!r}")
        merged[key] = value
    return merged


def fields_load(path: str, known: Sequence[str], what: str) -> dict:
    """A YAML (or JSON) mapping of request fields from ``path`` ('-': stdin); unknown fields are refused."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} file {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise UsageError(f"{path} must be a mapping of the {what}'s fields ({', '.join(known)})")
    unknown = sorted(set(loaded) - set(known))
    if unknown:
        raise UsageError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if isinstance(loaded.get("command"), str):
        loaded["command"] = ["/bin/sh", "-c", loaded["command"]]
    return loaded


def poll_interval() -> float:
    try:
        return max(0.05, float(os.environ.get("GPUSHARE_POLL_INTERVAL", "2")))
    except ValueError:
        return 2.0


def outage_patience() -> float:
    try:
        return float(os.environ.get("GPUSHARE_OUTAGE_PATIENCE", "900"))
    except ValueError:
        return 900.0


# --- the root command -------------------------------------------------------------------


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT, epilog=EPILOG)
@click.option("--url", help="The platform's address (default: $GPUSHARE_URL or the config file).")
@click.option("--token", help="API token (default: $GPUSHARE_TOKEN or the config file).")
@click.option(
    "--retries", type=click.IntRange(0, 100), default=6, show_default=True, help="Retries of a transient failure."
)
@output_options
@click.version_option(__version__, prog_name="gpushare")
@click.pass_context
def gpushare(ctx: click.Context, url: str | None, token: str | None, retries: int) -> None:
    """Submit and follow GPU jobs, and deploy inference endpoints, on gpushare."""
    found = ctx.ensure_object(State)  # main() passes one, so the output options' callbacks find it
    found.url, found.token, found.retries = url, token, retries


def config_error(exc: ConfigError) -> int:
    err(str(exc))
    return EXIT_USAGE
