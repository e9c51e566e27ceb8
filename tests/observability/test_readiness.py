"""Readiness fails while PostgreSQL or the broker is unreachable, and recovers, for the web
(the web server as deployed), a Celery worker and beat (heartbeat + exec probe),
the gateway and the node agent. Each talks to the shared PostgreSQL and Redis through a
proxy this test cuts and restores; the shared servers are never touched."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests
from django.conf import settings

from gpushare.observability.health import READY_CACHE_S
from tests.factories import TenantFactory, token_for, wait_for
from tests.processes import free_port, process_env

from .conftest import beat_process, via, web_server
from .helpers import scrape, status, value

pytestmark = pytest.mark.integration

TOKEN = "metrics-token-for-tests-0123456789"


def readyz(url: str) -> tuple[int, dict]:
    response = requests.get(f"{url}/readyz", timeout=30)
    return response.status_code, response.json()


def wait_status(url: str, path: str, code: int, what: str, timeout: float = 40) -> None:
    wait_for(lambda: status(url, path) == code, timeout=timeout, what=what)


@pytest.mark.django_db(transaction=True)
def test_web_readiness_follows_the_database_broker_and_cache(pg_proxy, redis_proxy, spawn):
    env = process_env()
    env.update(
        DATABASE_URL=via(pg_proxy, env["DATABASE_URL"]),
        REDIS_URL=via(redis_proxy, settings.REDIS_URL),
        GPUSHARE_METRICS_TOKEN=TOKEN,
    )
    url = web_server(spawn, env)
    assert readyz(url) == (200, {"ready": True, "checks": {"database": "ok", "broker": "ok", "cache": "ok"}})

    pg_proxy.cut()
    # (each process reuses its checks for up to a second: wait for one made after the cut)
    code, body = wait_for(
        lambda: (r := readyz(url))[0] == 503 and r[1]["checks"]["database"] != "ok" and r,
        timeout=20,
        what="503 without PostgreSQL",
    )
    assert body["ready"] is False
    assert body["checks"]["database"] != "ok" and body["checks"]["broker"] == "ok"
    assert status(url, "/healthz") == 200  # alive all along: a restart would not help
    pg_proxy.restore()
    wait_status(url, "/readyz", 200, "the web to be ready again after PostgreSQL came back")
    time.sleep(READY_CACHE_S + 0.1)  # no process still holds a result from the outage

    redis_proxy.cut()
    code, body = wait_for(
        lambda: (r := readyz(url))[0] == 503 and r[1]["checks"]["broker"] != "ok" and r,
        timeout=20,
        what="503 without Redis",
    )
    assert body["checks"]["broker"] != "ok" and body["checks"]["cache"] != "ok", body
    assert body["checks"]["database"] == "ok"
    redis_proxy.restore()
    wait_status(url, "/readyz", 200, "the web to be ready again after Redis came back")


@pytest.mark.django_db(transaction=True)
def test_web_metrics_need_the_token_and_count_requests_by_route_and_status(spawn):
    env = process_env({"GPUSHARE_METRICS_TOKEN": TOKEN})
    url = web_server(spawn, env)
    tenant = TenantFactory(slug="metrics-a")
    auth = {"Authorization": f"Bearer {token_for(tenant)}"}
    for _ in range(3):  # two web workers: the scrape must add both up
        assert requests.get(f"{url}/api/v1/jobs/", headers=auth, timeout=30).status_code == 200
    assert requests.get(f"{url}/api/v1/jobs/999999/", headers=auth, timeout=30).status_code == 404
    assert requests.get(f"{url}/api/v1/jobs/", timeout=30).status_code == 401

    assert requests.get(f"{url}/metrics", timeout=30).status_code == 401
    refused = requests.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
    samples = scrape(url, TOKEN)
    by_route = "django_http_responses_total_by_status_view_method_total"
    assert value(samples, by_route, view="job-list", method="GET", status="200") == 3
    assert value(samples, by_route, view="job-detail", method="GET", status="404") == 1
    assert value(samples, by_route, view="job-list", method="GET", status="401") == 1
    latency = "django_http_requests_latency_seconds_by_view_method_count"
    assert value(samples, latency, view="job-list", method="GET") == 4
    # Probes are not traffic.
    assert not [labels for labels, _ in samples[by_route] if labels["view"] in ("healthz", "readyz")]


@pytest.mark.django_db(transaction=True)
def test_worker_and_beat_readiness_read_their_heartbeat(pg_proxy, redis_proxy, spawn, tmp_path):
    broker = via(redis_proxy, settings.REDIS_URL)
    port = free_port()
    heartbeats = tmp_path / "heartbeat"
    env = process_env(
        {
            "DATABASE_URL": via(pg_proxy, process_env()["DATABASE_URL"]),
            "REDIS_URL": broker,
            "GPUSHARE_METRICS_PORT": str(port),
            "GPUSHARE_HEARTBEAT_DIR": str(heartbeats),
            "GPUSHARE_HEARTBEAT_S": "0.5",
        }
    )
    # A worker on a queue of its own: it takes nothing from the session's worker.
    spawn(
        "probe-worker",
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "gpushare",
            "worker",
            "-Q",
            f"probe-{port}",
            "-c",
            "1",
            "-l",
            "info",
            "-n",
            f"probe-{port}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env,
    )
    worker = f"http://127.0.0.1:{port}"
    _, beat = beat_process(
        spawn, tmp_path, {"REDIS_URL": broker, "GPUSHARE_HEARTBEAT_DIR": str(heartbeats), "GPUSHARE_HEARTBEAT_S": "0.5"}
    )

    def probe(role: str) -> tuple[int, dict]:
        done = subprocess.run(
            [sys.executable, "-m", "gpushare.observability.probe", role],
            env={**env, "GPUSHARE_HEARTBEAT_DIR": str(heartbeats)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.returncode, json.loads(done.stdout)

    wait_status(worker, "/readyz", 200, "the worker to be ready", timeout=60)
    wait_status(beat, "/readyz", 200, "beat to be ready", timeout=60)
    assert probe("worker")[0] == 0 and probe("beat")[0] == 0

    pg_proxy.cut()
    wait_status(worker, "/readyz", 503, "the worker to be unready without PostgreSQL")
    code, report = probe("worker")
    assert code == 1 and report["checks"]["database"] != "ok" and "database" in report["reason"]
    assert status(beat, "/readyz") == 200  # beat needs no database
    pg_proxy.restore()
    wait_status(worker, "/readyz", 200, "the worker to recover")

    redis_proxy.cut()
    wait_status(worker, "/readyz", 503, "the worker to be unready without the broker")
    wait_status(beat, "/readyz", 503, "beat to be unready without the broker")
    assert probe("beat")[0] == 1
    assert status(worker, "/healthz") == 200
    redis_proxy.restore()
    wait_status(worker, "/readyz", 200, "the worker to recover from the broker outage")
    wait_status(beat, "/readyz", 200, "beat to recover from the broker outage")
    assert probe("worker")[0] == 0 and probe("beat")[0] == 0


def test_agent_readiness_follows_its_broker(platform, agent_factory, redis_proxy):
    port = free_port()
    agent_factory("ready-node", extra=["--broker", via(redis_proxy, settings.REDIS_URL), "--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}"
    wait_status(url, "/readyz", 200, "the agent to be ready")
    redis_proxy.cut()
    wait_status(url, "/readyz", 503, "the agent to be unready while the broker is cut")
    assert status(url, "/healthz") == 200  # it keeps sampling and spooling: alive
    assert value(scrape(url), "gpushare_agent_broker_connected", Hostname="ready-node") == 0
    redis_proxy.restore()
    wait_status(url, "/readyz", 200, "the agent to reconnect")


def test_gateway_readiness_follows_the_database(platform, pg_proxy, spawn):
    port = free_port()
    env = process_env()
    env["DATABASE_URL"] = via(pg_proxy, env["DATABASE_URL"])
    spawn("gateway", [sys.executable, "-m", "endpoints", "--port", str(port)], env)
    url = f"http://127.0.0.1:{port}"
    wait_status(url, "/readyz", 200, "the gateway to be ready")
    pg_proxy.cut()
    wait_status(url, "/readyz", 503, "the gateway to be unready without PostgreSQL")
    assert status(url, "/healthz") == 200
    pg_proxy.restore()
    wait_status(url, "/readyz", 200, "the gateway to recover")
