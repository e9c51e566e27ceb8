"""The web server: ``python -m gpushare.serve`` (granian, WSGI, ``gpushare.wsgi:application``).

granian parses HTTP in Rust (hyper) and hands each request to a thread of the worker process that
runs Django. The same submits cost the web ~0.5 ms of CPU less each than under gunicorn's threaded
workers (4.5-5.2 against 5.2-5.8 ms, one client, same stack; docs/benchmarks.md, session 15),
whose Python parser and poller-to-thread hand-off were a fifth of the web's CPU.

Settings, from the environment (flags win; ``python -m gpushare.serve --help``):

- ``WEB_BIND`` (``0.0.0.0:8000``), ``WEB_CONCURRENCY`` (worker processes, 3), ``WEB_THREADS``
  (threads per worker, 4), ``WEB_BACKLOG`` (2048);
- ``WEB_THREADS_IDLE_TIMEOUT`` (seconds, 5-600; 600): how long granian keeps a thread that serves
  nothing. Each thread holds its own database connection (Django's are per thread), so a thread
  granian ends and starts again costs the next request on it a new connection, ~15 ms (an array
  submit on a new connection took 22 ms in the bench's rounds, against 6-9 ms; granian's default is
  30 s; docs/benchmarks.md, session 28);
- ``LOG_FORMAT`` / ``LOG_LEVEL``: the server's own lines go through the platform's handler; there
  is no access log, ``gpushare.request`` logs each request with its id, tenant, status and duration;
- ``PROMETHEUS_MULTIPROC_DIR``: where every worker writes its series (prometheus-client's
  multiprocess mode; ``/metrics`` adds them up, whichever worker answers). Emptied at start when
  given (e.g. an emptyDir); else a fresh directory is made here and removed at exit.

A worker that dies is started again (``respawn_failed_workers``); on SIGTERM the workers finish
what they serve for up to 30 s (``WEB_GRACEFUL_TIMEOUT``), then are killed.
"""

from __future__ import annotations

import argparse
import os
import shutil


def _bind(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 0.0.0.0:8000, not {text!r}")
    return host.strip("[]"), int(port)


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return int(text)


def _idle_timeout(text: str) -> int:
    if not text.strip().isdigit() or not 5 <= int(text) <= 600:
        raise argparse.ArgumentTypeError(f"expected whole seconds from 5 to 600 (granian's range), not {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m gpushare.serve", description=__doc__.split("\n\n")[0])
    # String defaults go through ``type`` as flags do: a bad WEB_* value is a usage error naming the option.
    p.add_argument("--bind", type=_bind, default=env("WEB_BIND", "0.0.0.0:8000"), help="HOST:PORT (WEB_BIND)")
    p.add_argument("--workers", type=_positive, default=env("WEB_CONCURRENCY", "3"), help="processes")
    p.add_argument("--threads", type=_positive, default=env("WEB_THREADS", "4"), help="threads per process")
    p.add_argument(
        "--threads-idle-timeout",
        type=_idle_timeout,
        default=env("WEB_THREADS_IDLE_TIMEOUT", "600"),
        help="seconds an idle thread (and its database connection) is kept",
    )
    p.add_argument("--backlog", type=_positive, default=env("WEB_BACKLOG", "2048"))
    p.add_argument("--graceful-timeout", type=_positive, default=env("WEB_GRACEFUL_TIMEOUT", "30"))
    return p


def metrics_dir() -> str | None:
    """Choose ``PROMETHEUS_MULTIPROC_DIR`` before any worker starts (they inherit it); the directory to
    remove at exit, if this made it."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:  # the operator's (e.g. an emptyDir): a previous run's files are stale
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        return None
    from gpushare.observability.multiproc import metrics_dir_create

    path = metrics_dir_create("gpushare-web-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def log_config() -> dict:
    """The platform's logging (``gpushare.observability.logs``), granian's own logger through its handler."""
    from gpushare.observability.logs import logging_config

    config = logging_config(fmt=os.environ.get("LOG_FORMAT", "plain"), level=os.environ.get("LOG_LEVEL", "INFO"))
    config["loggers"]["_granian"] = {"handlers": ["console"], "level": "INFO", "propagate": False}
    config["loggers"]["granian.access"] = {"handlers": ["console"], "level": "WARNING", "propagate": False}
    return config


def _level(name: str):
    from granian.log import LogLevels

    try:
        return LogLevels(name.lower())
    except ValueError:
        return LogLevels.info


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
    created = metrics_dir()
    from granian import Granian
    from granian.constants import Interfaces

    host, port = args.bind
    server = Granian(
        "gpushare.wsgi:application",
        address=host,
        port=port,
        interface=Interfaces.WSGI,
        workers=args.workers,
        blocking_threads=args.threads,
        blocking_threads_idle_timeout=args.threads_idle_timeout,
        backlog=args.backlog,
        log_dictconfig=log_config(),
        log_level=_level(os.environ.get("LOG_LEVEL", "INFO")),
        respawn_failed_workers=True,
        workers_kill_timeout=args.graceful_timeout,
    )
    try:
        server.serve()
    finally:
        if created:
            shutil.rmtree(created, ignore_errors=True)


if __name__ == "__main__":
    main()
