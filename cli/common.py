"""What the job and endpoint commands share: exit codes, stderr messages, argument
types, request-body files, transient-failure patience, and following a job's log."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from .client import ApiError, Client

# The exit codes of the module doc of cli/main.py.
EXIT_USAGE = 2
EXIT_CANCELLED = 120
EXIT_GAVE_UP = 121
EXIT_TIMEOUT = 124
EXIT_API = 125


class UsageError(Exception):
    """A bad command line, configuration or input file: exit 2."""


def err(message: str) -> None:
    print(f"gpushare: {message}", file=sys.stderr, flush=True)


def print_out(data, as_json: bool, lines=None) -> None:
    """``lines`` for people; the API's JSON with ``--json`` (or when there are no lines)."""
    if as_json or lines is None:
        print(json.dumps(data, indent=None if as_json else 2))
        return
    for line in lines:
        print(line)


def poll_interval() -> float:
    try:
        return max(0.05, float(os.environ.get("GPUSHARE_POLL_INTERVAL", "2")))
    except ValueError:
        return 2.0


def transient(exc: ApiError) -> bool:
    """Unreachable, or the platform's own trouble: worth waiting out."""
    return exc.status is None or exc.status >= 500 or exc.status == 429


def outage_patience() -> float:
    try:
        return float(os.environ.get("GPUSHARE_OUTAGE_PATIENCE", "900"))
    except ValueError:
        return 900.0


def gpus_arg(text: str) -> int | float:
    """``--gpus``: whole GPUs as an int (the API's shape), a slice as a float; the platform checks the value."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("gpus is a number: 1-8, or 0.125, 0.25, 0.5") from exc
    return int(value) if value.is_integer() else value


def fields_load(path: str, known: tuple[str, ...], what: str) -> dict:
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


def env_merge(env: dict | None, pairs: list[str]) -> dict:
    """``env`` with each ``--env KEY=VALUE`` set over it."""
    merged = dict(env or {})
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--env takes KEY=VALUE, got {pair!r}")
        merged[key] = value
    return merged


def command_arg(words: list[str]) -> list[str]:
    """The command after ``--`` (argparse.REMAINDER keeps the ``--`` itself)."""
    return words[1:] if words and words[0] == "--" else list(words)


class LogFollower:
    """Prints a job's log from where it left off."""

    def __init__(self, client: Client, job_id: int, *, offset: int = 0, out=None):
        self.client, self.job_id, self.offset = client, job_id, offset
        self.out = out or sys.stdout
        self.complete = False

    def poll(self) -> bool:
        """Print what is new; True when something was printed."""
        page = self.client.job_logs(self.job_id, offset=self.offset)
        if page["data"]:
            self.out.write(page["data"])
            self.out.flush()
        printed = page["next_offset"] != self.offset
        self.offset = page["next_offset"]
        self.complete = bool(page.get("complete"))
        return printed
