"""Log lines: JSON in production with the request id, tenant and job of a real request;
periodic tasks quiet unless they did something; the agent's lines name node and job."""

from __future__ import annotations

import io
import json
import logging
import logging.config

import pytest
from django.test import Client

from agents.agent.logs import AgentContext
from gpushare.observability.logs import PeriodicTaskFilter, did_something, logging_config
from tests.factories import TenantFactory, token_for

TRACE = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s"


@pytest.fixture
def json_lines():
    """Route the root logger through production's JSON handler into a buffer for one test."""
    config = logging_config(fmt="json", level="INFO")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.config.dictConfigClass(config).configure_formatter(dict(config["formatters"]["json"])))
    from gpushare.observability.context import ContextFilter

    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    root.removeHandler(handler)


@pytest.mark.django_db
def test_a_request_logs_one_json_line_with_its_id_tenant_and_job(json_lines):
    tenant = TenantFactory(slug="logs-a")
    client = Client()
    response = client.get(
        "/api/v1/jobs/424242/", HTTP_AUTHORIZATION=f"Bearer {token_for(tenant)}", HTTP_X_REQUEST_ID="ci-run-1234-abcd"
    )
    assert response.status_code == 404
    assert response["X-Request-ID"] == "ci-run-1234-abcd"
    lines = [line for line in json_lines() if line["logger"] == "gpushare.request"]
    assert len(lines) == 1
    line = lines[0]
    assert line["message"].startswith("GET /api/v1/jobs/424242/ 404")
    assert {k: line[k] for k in ("level", "request_id", "tenant", "job", "status")} == {
        "level": "INFO",
        "request_id": "ci-run-1234-abcd",
        "tenant": "logs-a",
        "job": 424242,
        "status": 404,
    }
    assert "time" in line
    # The server's own time is sent back too, the figure the line logs (in whole ms there).
    timing = response["Server-Timing"]
    assert timing.startswith("app;dur=")
    logged_ms = int(line["message"].rsplit(" ", 1)[1].removesuffix("ms"))
    assert abs(float(timing.removeprefix("app;dur=")) - logged_ms) <= 0.5


@pytest.mark.django_db
def test_a_request_id_that_is_not_one_is_replaced():
    response = Client().get("/accounts/login/", HTTP_X_REQUEST_ID="bad id\nwith newline")
    assert len(response["X-Request-ID"]) == 32 and response["X-Request-ID"].isalnum()


def record(name: str, msg: str, args, level=logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


@pytest.mark.parametrize(
    ("value", "did"),
    [
        ("None", False),
        ("0", False),
        ("[]", False),
        ("{'placed': 0, 'pending': 3}", False),
        ("{'alerted': 0, 'stopped': 0}", False),
        ("2", True),
        ("['node-1']", True),
        ("{'placed': 1, 'pending': 0}", True),
        ("<object at 0x1>", True),
    ],
)
def test_did_something(value, did):
    assert did_something(value) is did


def test_periodic_tasks_are_quiet_unless_they_did_something():
    quiet = PeriodicTaskFilter(tasks=["endpoints.autoscale", "scheduler.pass"])
    idle = record(
        "celery.app.trace", TRACE, {"name": "endpoints.autoscale", "id": "1", "runtime": 0.01, "return_value": "0"}
    )
    placed = record(
        "celery.app.trace",
        TRACE,
        {"name": "scheduler.pass", "id": "2", "runtime": 0.1, "return_value": "{'placed': 2, 'pending': 0}"},
    )
    other = record(
        "celery.app.trace", TRACE, {"name": "agents.usage", "id": "3", "runtime": 0.1, "return_value": "None"}
    )
    received = record("celery.worker.strategy", "Task %(name)s[%(id)s] received", {"name": "scheduler.pass", "id": "4"})
    sending = record(
        "celery.beat", "Scheduler: Sending due task %s (%s)", ("endpoints-autoscale", "endpoints.autoscale")
    )
    failure = record(
        "celery.app.trace", "Task %(name)s[%(id)s] raised", {"name": "scheduler.pass", "id": "5"}, logging.ERROR
    )
    for logger in ("celery.app.trace", "celery.worker.strategy", "celery.beat"):
        logging.getLogger(logger).setLevel(logging.INFO)
    assert [quiet.filter(r) for r in (idle, placed, other, received, sending, failure)] == [
        False,
        True,
        True,
        False,
        False,
        True,
    ]
    assert idle.levelname == "DEBUG" and failure.levelname == "ERROR"
    logging.getLogger("celery.beat").setLevel(logging.DEBUG)  # LOG_LEVEL=DEBUG shows them again
    try:
        again = record("celery.beat", "Scheduler: Sending due task %s (%s)", ("a", "b"))
        assert quiet.filter(again) is True and again.levelname == "DEBUG"
    finally:
        logging.getLogger("celery.beat").setLevel(logging.NOTSET)


def test_agent_lines_carry_the_node_and_the_job():
    context = AgentContext("gpu-node-7")
    started = record("gpushare.agent", "job %s attempt %s started on %s", (42, 1, ["GPU-1"]))
    stopping = record("gpushare.agent", "stopping job %s: %s", (43, "memory"))
    other = record("gpushare.agent", "broker unreachable (%s); spooling locally", ("refused",))
    for r in (started, stopping, other):
        context.filter(r)
    assert (started.node, started.job, stopping.job, other.node) == ("gpu-node-7", 42, 43, "gpu-node-7")
    assert getattr(other, "job", None) is None


def test_a_metrics_dir_of_a_process_that_is_gone_is_removed(tmp_path, monkeypatch):
    import os
    import subprocess

    from gpushare.observability.multiproc import metrics_dir_create

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"gpushare-metrics-{dead.pid}-old").mkdir()  # SIGKILLed before its exit hook
    (tmp_path / f"gpushare-metrics-{os.getppid()}-live").mkdir()  # a running worker's
    fresh = metrics_dir_create("gpushare-metrics-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"gpushare-metrics-{os.getppid()}-live", os.path.basename(fresh)]
    )
    assert os.path.basename(fresh).startswith(f"gpushare-metrics-{os.getpid()}-")
