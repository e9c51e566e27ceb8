"""The platform's Celery application (web, worker and beat share it)."""

import atexit
import logging
import os
import shutil

from celery import Celery, bootsteps
from celery.signals import task_postrun, task_prerun
from kombu import transport as kombu_transports

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpushare.settings.dev")
# A worker or beat that serves metrics (GPUSHARE_METRICS_PORT) counts its pool's tasks in
# files the scrape adds up (prometheus-client's multiprocess mode): the directory must be
# chosen before prometheus_client is first imported, and be fresh for each start.
if os.environ.get("GPUSHARE_METRICS_PORT") and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from gpushare.observability.multiproc import metrics_dir_create

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir = metrics_dir_create("gpushare-metrics-")
    _metrics_owner = os.getpid()  # the pool's children exit too: only this process removes it
    atexit.register(lambda: os.getpid() == _metrics_owner and shutil.rmtree(_metrics_dir, ignore_errors=True))

from agents.agent.brokerconf import PLATFORM_QUEUE

log = logging.getLogger(__name__)

# Nodes can write to the report queue: a message there that is not even kombu's envelope is dropped
# with a log line instead of stopping the worker (agents/kombu_redis.py).
kombu_transports.TRANSPORT_ALIASES.update(redis="agents.kombu_redis:Transport", rediss="agents.kombu_redis:Transport")

app = Celery("gpushare")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Database connections in the worker: as in the web, not one per task.
# Celery's Django fixup closes every connection after every task unless
# CELERY_DB_REUSE_MAX is set; a fresh PostgreSQL connection per metering batch
# or scheduling pass costs more than many of those tasks' own queries. With the
# fixup's recycling out of the way, each task starts and ends the way a web
# request does: ``close_old_connections`` drops a connection past CONN_MAX_AGE
# or broken by an error, and arms CONN_HEALTH_CHECKS, so a connection the
# server killed while idle is replaced before the task's first query.
app.conf.CELERY_DB_REUSE_MAX = 1 << 62


@task_prerun.connect
@task_postrun.connect
def _connections_tidy(**_kwargs) -> None:
    from django.db import close_old_connections

    close_old_connections()


class ReportGate(bootsteps.StartStopStep):
    """The report queue's consumer: only node reports run from it; anything else is refused.

    Node credentials can publish to the report queue (``reports``) and nowhere
    else; platform tasks (scheduling passes, invoice close, Stripe sync...) come
    only from the platform queue, which nodes cannot write to. On Redis the
    message itself cannot say which queue it was taken from (its delivery info
    is the publisher's), so the worker consumes the report queue with a consumer
    of its own: a message there whose task is not a report is logged, recorded
    as a refusal (through the platform queue) and dropped, never run. Reports
    it hands to the worker's usual handler, on the task consumer's channel (so
    the worker's prefetch limit covers both queues).
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c, **kwargs):
        super().__init__(c, **kwargs)
        self.consumer = None

    def start(self, c):
        from kombu import Consumer, Exchange, Queue

        from agents.agent.protocol import REPORT_QUEUE, REPORTS

        handler = c.create_task_handler()
        allowed = frozenset(REPORTS)
        app = c.app

        def on_message(message):
            headers = message.headers if isinstance(message.headers, dict) else {}
            task = str(headers.get("task", ""))
            if task in allowed:
                return handler(message)
            log.error("a %r message arrived on the report queue: refused, not run", task[:100])
            app.send_task(
                "agents.link_refusal",
                kwargs={
                    "direction": "report",
                    "task": task[:100],
                    "reason": "not a report: arrived on the report queue",
                },
                queue=PLATFORM_QUEUE,
            )
            message.ack()

        queue = Queue(REPORT_QUEUE, Exchange(REPORT_QUEUE), routing_key=REPORT_QUEUE)
        self.consumer = Consumer(c.task_consumer.channel, queues=[queue], on_message=on_message, accept=["json"])
        self.consumer.consume()

    def stop(self, c):
        if self.consumer is not None:
            try:
                self.consumer.cancel()
            except Exception as exc:  # noqa: BLE001 - the connection may be gone already
                log.debug("cancelling the report consumer: %s", exc)
            self.consumer = None

    shutdown = stop


app.steps["consumer"].add(ReportGate)


# Production running: logging, task metrics and log context, heartbeat and ops server
# (gpushare/observability/worker.py says what each does).
def _observability_connect() -> None:
    from celery import signals

    from gpushare.observability import worker as ops

    signals.setup_logging.connect(ops.logging_setup, weak=False)
    signals.task_prerun.connect(ops.task_prerun, weak=False)
    signals.task_postrun.connect(ops.task_postrun, weak=False)
    signals.worker_ready.connect(ops.worker_ready, weak=False)
    signals.worker_shutting_down.connect(ops.worker_shutting_down, weak=False)
    signals.beat_init.connect(ops.beat_init, weak=False)
    # What the worker keeps, out of the garbage collector's full walks (gpushare/heap.py): in the main
    # process before its pool's children fork (they start with it frozen), and in each child once set up.
    signals.worker_init.connect(_heap_settle, weak=False)
    signals.worker_process_init.connect(_heap_settle, weak=False)


def _heap_settle(**_kwargs) -> None:
    from gpushare.heap import heap_settle

    heap_settle()


_observability_connect()
