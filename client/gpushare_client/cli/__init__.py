"""``gpushare``: the command line for CI pipelines and people (docs/ci.md), on the SDK.

stdout carries each command's result (human lines by default, the API's JSON with
``-o json``, the job id alone with ``submit -q``); stderr carries progress and
errors. Exit codes: ``gpushare --help``.
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import ApiError, ConfigError
from . import account, endpoints, jobs  # noqa: F401  (they register their commands)
from .app import EXIT_API, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_USAGE, State, err, gpushare
from .jobs import job_exit_code

__all__ = ["EXIT_API", "EXIT_USAGE", "gpushare", "job_exit_code", "main", "run_cli"]


def run_cli(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code (``main`` exits with it)."""
    try:
        result = gpushare.main(args=argv, prog_name="gpushare", standalone_mode=False, obj=State())
        code = result if isinstance(result, int) else 0
        sys.stdout.flush()
        return code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
    except click.exceptions.Abort:
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        err(str(exc))
        return EXIT_USAGE
    except ApiError as exc:
        err(f"{exc.code + ': ' if exc.code else ''}{exc}")
        return EXIT_API
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (gpushare list | head): stop quietly, as other tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_cli(argv))
