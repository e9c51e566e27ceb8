"""The platform's Prometheus series (prometheus-client), and how a scrape collects them.

The series:

| series | type | labels | what |
|---|---|---|---|
| ``django_http_responses_total_by_status_view_method_total`` | counter | status, view, method | web responses |
| ``django_http_requests_latency_seconds_by_view_method`` | histogram | view, method | web request time |
| ``gpushare_celery_tasks_total`` | counter | task, outcome | tasks run by the worker: succeeded, failed, retried |
| ``gpushare_celery_task_seconds`` | histogram | task | task run time |
| ``gpushare_celery_queue_messages`` | gauge | queue | messages waiting in each queue (platform, node.*) |
| ``gpushare_scheduler_pass_seconds`` | histogram | | one scheduling pass |
| ``gpushare_scheduler_pass_placements`` | histogram | | jobs placed by one pass |
| ``gpushare_scheduler_placements_total`` | counter | | jobs placed |
| ``gpushare_scheduler_preemptions_total`` | counter | | jobs preempted |
| ``gpushare_scheduler_moves_total`` | counter | | slices moved to free GPUs for a waiting job (defragmentation) |
| ``gpushare_usage_windows_total`` | counter | outcome | metering windows: stored, rejected, replayed |
| ``gpushare_usage_ingest_lag_seconds`` | histogram | | from a window's end on the node to it being stored |
| ``gpushare_stripe_webhook_refused_total`` | counter | reason | Stripe events refused (e.g. amount_mismatch) |

Processes that start workers (the web server, the Celery prefork pool) keep their series in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode; set for
them by ``gpushare/serve.py`` and ``gpushare/celery.py``), and a
scrape adds up every process's files.
"""

from __future__ import annotations

import logging
import os
import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

TASK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 900, 3600)
PLACEMENT_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

# The web's two series, under the names and labels django-prometheus gave them (dashboards and alerts read
# them), recorded by the request's own middleware (``observability.middleware``: ``web_request_observe``).
# django-prometheus' two middlewares recorded twelve series a request, of which these two were read:
# 0.05-0.07 ms of a submit's ~1.8 ms of CPU in the web process.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 25, 50, 75, float("inf"))
WEB_RESPONSES = Counter(
    "django_http_responses_total_by_status_view_method",
    "Count of responses by status, view, method.",
    ["status", "view", "method"],
)
WEB_LATENCY = Histogram(
    "django_http_requests_latency_seconds_by_view_method",
    "Histogram of request processing time labelled by view.",
    ["view", "method"],
    buckets=LATENCY_BUCKETS,
)
# A method outside these is counted as one label value: a client cannot grow the series with made-up verbs.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
TASKS = Counter("gpushare_celery_tasks", "Celery tasks run, by outcome.", ["task", "outcome"])
TASK_SECONDS = Histogram("gpushare_celery_task_seconds", "Celery task run time.", ["task"], buckets=TASK_BUCKETS)
PASS_SECONDS = Histogram("gpushare_scheduler_pass_seconds", "Duration of one scheduling pass.", buckets=TASK_BUCKETS)
PASS_PLACEMENTS = Histogram(
    "gpushare_scheduler_pass_placements", "Jobs placed by one scheduling pass.", buckets=PLACEMENT_BUCKETS
)
PLACEMENTS = Counter("gpushare_scheduler_placements", "Jobs placed by scheduling passes.")
PREEMPTIONS = Counter("gpushare_scheduler_preemptions", "Jobs preempted by scheduling passes.")
MOVES = Counter("gpushare_scheduler_moves", "Slices moved by scheduling passes to free GPUs (defragmentation).")
WINDOWS = Counter("gpushare_usage_windows", "Metering windows received from nodes, by outcome.", ["outcome"])
INGEST_LAG = Histogram(
    "gpushare_usage_ingest_lag_seconds",
    "Time from the end of a metering window on the node to the window being stored.",
    buckets=LAG_BUCKETS,
)
STRIPE_REFUSED = Counter("gpushare_stripe_webhook_refused", "Stripe webhook events refused, by reason.", ["reason"])


# --- hooks called by the services ------------------------------------------------------


def web_request_observe(*, view: str | None, method: str, status: int, seconds: float) -> None:
    """A web response: its view's route name ("<unnamed view>" where no route matched), the method and status."""
    view = view or "<unnamed view>"
    method = method if method in HTTP_METHODS else "<invalid method>"
    WEB_RESPONSES.labels(str(status), view, method).inc()
    WEB_LATENCY.labels(view, method).observe(seconds)


def scheduler_pass_observe(result) -> None:
    """After a pass (``scheduler.passes.PassResult``)."""
    PASS_SECONDS.observe(result.seconds)
    PASS_PLACEMENTS.observe(result.placed)
    PLACEMENTS.inc(result.placed)
    PREEMPTIONS.inc(getattr(result, "preempted", 0))
    MOVES.inc(getattr(result, "moved", 0))


def usage_ingest_observe(*, outcome: dict, end_ms: list[int], now_ms: int | None = None) -> None:
    """After an ingest: its ``{"stored", "rejected", "replayed"}`` counts and the stored windows' ends."""
    for name in ("stored", "rejected", "replayed"):
        if outcome.get(name):
            WINDOWS.labels(name).inc(outcome[name])
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    for end in end_ms:
        INGEST_LAG.observe(max(0, now_ms - end) / 1000)


# --- Celery task signals ------------------------------------------------------------------

_started: dict[str, float] = {}


def task_started(task_id: str) -> None:
    _started[task_id] = time.perf_counter()


def task_finished(task_name: str, task_id: str, state: str | None) -> None:
    began = _started.pop(task_id, None)
    if began is not None:
        TASK_SECONDS.labels(task_name).observe(time.perf_counter() - began)
    outcome = {"SUCCESS": "succeeded", "FAILURE": "failed", "RETRY": "retried"}.get(state or "", (state or "").lower())
    if outcome:
        TASKS.labels(task_name, outcome).inc()


# --- queue depth, read at scrape time -------------------------------------------------------


class QueueDepthCollector:
    """``gpushare_celery_queue_messages{queue}``: the platform queue and every node's queue.

    Read from the broker at each scrape (one round trip per queue); a broker
    that does not answer yields no sample rather than a failed scrape.
    """

    def collect(self):
        from django.conf import settings

        from agents.agent.brokerconf import node_queue
        from agents.models import Node
        from gpushare.celery import app

        family = GaugeMetricFamily(
            "gpushare_celery_queue_messages", "Messages waiting in a Celery queue.", labels=["queue"]
        )
        queues = [settings.CELERY_TASK_DEFAULT_QUEUE, *getattr(settings, "GPUSHARE_EXTRA_QUEUES", ())]
        try:
            queues += [node_queue(name) for name in Node.objects.order_by("name").values_list("name", flat=True)]
        except Exception as exc:  # noqa: BLE001 - the database is down: report the platform queues only
            log.debug("queue depth: no node list (%s)", exc)
        try:
            with app.connection_for_read() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=3)
                channel = conn.default_channel
                for queue in dict.fromkeys(queues):
                    family.add_metric([queue], _queue_size(channel, queue))
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the broker is down
            log.debug("queue depth: broker unreachable (%s)", exc)
            return
        yield family


def _queue_size(channel, queue: str) -> int:
    from kombu.exceptions import ChannelError

    try:
        return channel.queue_declare(queue=queue, passive=True).message_count
    except ChannelError:
        return 0  # never declared, or empty and gone (Redis keeps no empty lists)


_queue_collector = QueueDepthCollector()
_registered = False


def scrape_registry(*, queue_depth: bool = True) -> CollectorRegistry:
    """What a scrape of this process reports: every forked process's files in multiprocess mode."""
    global _registered
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        if queue_depth:
            registry.register(_queue_collector)
        return registry
    if queue_depth and not _registered:
        REGISTRY.register(_queue_collector)
        _registered = True
    return REGISTRY


def scrape(*, queue_depth: bool = True) -> bytes:
    return generate_latest(scrape_registry(queue_depth=queue_depth))
