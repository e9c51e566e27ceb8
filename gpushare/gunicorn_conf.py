"""gunicorn settings for the web: ``gunicorn -c python:gpushare.gunicorn_conf gpushare.wsgi``.

Flags on the command line still win (``-b``, ``-w``). What this adds:
- Prometheus multiprocess mode: every worker process writes its series into
  one fresh directory (``PROMETHEUS_MULTIPROC_DIR``, chosen here, in the
  master, before any worker starts) and ``/metrics`` adds them up, so a scrape
  sees the whole server whichever worker answers; a dead worker's files are
  marked so its live gauges drop out.
- The workers' heartbeat files in memory (``/dev/shm`` where there is one):
  a worker touches its file after every request it serves (gunicorn's
  watchdog: ``timeout``), and on a disk-backed ``/tmp`` that metadata write
  took ~4% of a worker's time in the submit benchmark (gunicorn's docs warn
  it "may block a worker for arbitrary time"). ``GUNICORN_WORKER_TMP_DIR``
  chooses another.
- No access log: ``gpushare.request`` logs each request with its id, tenant,
  status and duration, in the same format (JSON in production) as the rest;
  gunicorn's own lines go through the same handler (``logconfig_dict``).
"""

import os
import shutil

bind = os.environ.get("GUNICORN_BIND", "0.0.0.0:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "3"))
threads = int(os.environ.get("GUNICORN_THREADS", "4"))
accesslog = None
worker_tmp_dir = os.environ.get("GUNICORN_WORKER_TMP_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)


def _logconfig() -> dict:
    # Nothing here may import prometheus_client: the master must not load it before
    # on_starting has chosen PROMETHEUS_MULTIPROC_DIR (the workers inherit the master's modules).
    from gpushare.observability.logs import logging_config

    config = logging_config(fmt=os.environ.get("LOG_FORMAT", "plain"), level=os.environ.get("LOG_LEVEL", "INFO"))
    config["loggers"]["gunicorn.error"] = {"handlers": ["console"], "level": "INFO", "propagate": False}
    config["loggers"]["gunicorn.access"] = {"handlers": ["console"], "level": "WARNING", "propagate": False}
    return config


logconfig_dict = _logconfig()
# Probes and Prometheus must not wait behind a slow request for long.
timeout = int(os.environ.get("GUNICORN_TIMEOUT", "60"))
graceful_timeout = 30


_created = []


def on_starting(server):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:  # the operator's directory (e.g. an emptyDir): emptied, a previous run's files are stale
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    else:
        from gpushare.observability.multiproc import metrics_dir_create

        path = metrics_dir_create("gpushare-web-metrics-")
        _created.append(path)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    for path in _created:
        shutil.rmtree(path, ignore_errors=True)
