"""An endpoint served from shared slices: real worker, beat, agent and gateway
processes on PostgreSQL and Redis, a model server that sleeps per request."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import pytest
import requests
from django_scopes import scopes_disabled

from endpoints.models import Endpoint, Replica
from scheduler.models import JobState
from tests.factories import TenantFactory, token_for, wait_for

pytestmark = pytest.mark.integration

MODEL_SERVER = str(Path(__file__).with_name("model_server.py"))
SCOPES = ["jobs:read", "jobs:write", "usage:read", "endpoints:invoke"]


def deploy(platform, token: str, **overrides) -> dict:
    body = {
        "name": "echo",
        "command": [sys.executable, MODEL_SERVER],
        "env": {"SLEEP_S": "0.3"},
        "gpus": 0.25,
        "min_replicas": 0,
        "max_replicas": 4,
        "concurrency_target": 2,
        "idle_timeout_seconds": 4,
        "health_path": "/health",
        **overrides,
    }
    response = requests.post(
        f"{platform.url}/api/v1/endpoints/", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    assert response.status_code == 201, response.text
    return response.json()


def live_replicas(endpoint_id: int) -> list[Replica]:
    with scopes_disabled():
        return list(Replica.objects.filter(endpoint_id=endpoint_id).exclude(state=Replica.State.STOPPED))


def test_scale_from_zero_burst_and_back_to_zero_billed_per_replica_second(platform, agent_factory, gateway, beat):
    agent_factory("ep-node", gpus="sim:2xL4-24GB")
    tenant = TenantFactory(slug="acme")
    token = token_for(tenant, scopes=SCOPES)
    endpoint = deploy(platform, token)
    assert endpoint["replicas"] == [] and endpoint["url"] == "/e/acme/echo/"
    auth = {"Authorization": f"Bearer {token}"}

    # Cold start: the first request is held while a replica starts.
    started = time.monotonic()
    first = requests.post(f"{gateway}/e/acme/echo/predict", data=b"hello", headers=auth, timeout=120)
    cold_start = time.monotonic() - started
    assert first.status_code == 200, first.text
    assert first.json()["echo"] == "hello"

    # Sustained load from 16 concurrent clients at 2 per replica scales out; every request succeeds and
    # the load is spread over the new replicas as they become ready.
    def client(i: int) -> list[requests.Response]:
        answers, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            answers.append(requests.post(f"{gateway}/e/acme/echo/predict", data=str(i), headers=auth, timeout=120))
            if len({a.json()["pid"] for a in answers if a.ok}) >= 2 and len(answers) >= 3:
                break
        return answers

    with ThreadPoolExecutor(16) as pool:
        answers = [a for batch in pool.map(client, range(16)) for a in batch]
    assert {a.status_code for a in answers} == {200}, [a.text for a in answers if not a.ok][:3]
    assert len(live_replicas(endpoint["id"])) >= 2
    pids = {a.json()["pid"] for a in answers}

    # Streaming passes through chunk by chunk.
    with requests.get(f"{gateway}/e/acme/echo/stream", headers=auth, stream=True, timeout=60) as streamed:
        chunks = [(time.monotonic(), line) for line in streamed.iter_lines() if line]
    assert [line for _, line in chunks] == [f"token{i}".encode() for i in range(5)]
    assert chunks[-1][0] - chunks[0][0] > 0.5, "chunks arrived as they were produced, not buffered whole"

    # Silence: back to zero replicas after the idle timeout.
    wait_for(lambda: not live_replicas(endpoint["id"]), timeout=90, what="scale to zero")

    with scopes_disabled():
        replicas = list(Replica.objects.filter(endpoint_id=endpoint["id"]).select_related("job"))
        assert all(r.job.state in (JobState.CANCELLED, JobState.SUCCEEDED) for r in replicas)
        held_s = sum((r.job.finished_at - r.job.started_at).total_seconds() for r in replicas)
        cost = sum(r.job.cost for r in replicas)
    detail = wait_for(
        lambda: (
            (
                body := requests.get(
                    f"{platform.url}/api/v1/endpoints/{endpoint['id']}/", headers=auth, timeout=10
                ).json()
            )
            and Decimal(body["cost"]) > 0
            and body
        ),
        what="the endpoint's cost",
    )
    assert Decimal(detail["cost"]) == cost  # exact
    # Billed per replica-second: the metered replica time equals the replicas' run time.
    assert detail["replica_seconds"] == pytest.approx(held_s, abs=0.05 * len(replicas) + 0.01)
    metrics = requests.get(
        f"{platform.url}/api/v1/endpoints/{endpoint['id']}/metrics/", headers=auth, timeout=10
    ).json()
    reasons = [e["reason"] for e in metrics["scaling_events"]]
    assert any("idle" in r for r in reasons) and metrics["requests_total"] >= len(answers) + 1
    # The per-minute history holds every request (1 + the burst + the stream), with latencies and replicas.
    series = metrics["series"]
    assert sum(series["requests"]) == len(answers) + 2 and sum(series["errors"]) == 0
    assert max(p for p in series["p99_ms"] if p is not None) >= 1
    assert max(series["replicas"]) >= 2 and max(series["replicas_ready"]) >= 2
    assert sum(Decimal(day["cost"]) for day in metrics["cost_by_day"]) == cost
    assert len(pids) >= 2, "the burst was spread over several replicas"
    print(f"cold start {cold_start:.2f}s; replicas used {len(replicas)}; held {held_s:.1f}s; cost {cost}")


def test_rolling_update_under_steady_load_loses_no_request(platform, agent_factory, gateway, beat):
    agent_factory("ep-node", gpus="sim:2xL4-24GB")
    tenant = TenantFactory(slug="acme")
    token = token_for(tenant, scopes=SCOPES)
    auth = {"Authorization": f"Bearer {token}"}
    endpoint = deploy(platform, token, min_replicas=1, max_replicas=2, env={"SLEEP_S": "0.05", "MODEL_VERSION": "1"})
    wait_for(
        lambda: requests.post(f"{gateway}/e/acme/echo/predict", headers=auth, timeout=120).status_code == 200,
        timeout=120,
        what="the first replica",
    )
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def steady():
        while not stop.is_set():
            r = requests.post(f"{gateway}/e/acme/echo/predict", headers=auth, timeout=120)
            results.append((r.status_code, r.json().get("version") if r.ok else r.text))
            time.sleep(0.05)

    client = threading.Thread(target=steady)
    client.start()
    try:
        time.sleep(1)
        update = requests.patch(
            f"{platform.url}/api/v1/endpoints/{endpoint['id']}/",
            json={"env": {"SLEEP_S": "0.05", "MODEL_VERSION": "2"}},
            headers=auth,
            timeout=10,
        )
        assert update.status_code == 200, update.text
        assert update.json()["version"] == 2
        wait_for(
            lambda: results and results[-1][1] == "2" and all(r.version == 2 for r in live_replicas(endpoint["id"])),
            timeout=120,
            what="traffic on version 2 only",
        )
    finally:
        stop.set()
        client.join(timeout=30)
    failed = [r for r in results if r[0] != 200]
    assert not failed, failed[:5]
    versions = [v for _, v in results]
    assert versions[0] == "1" and versions[-1] == "2"
    # Once traffic moved to the new version it never went back.
    assert "1" not in versions[versions.index("2") :]


def test_another_tenant_gets_404_at_the_gateway_and_the_api(platform, agent_factory, gateway):
    tenant, other = TenantFactory(slug="acme"), TenantFactory(slug="globex")
    token, other_token = token_for(tenant, scopes=SCOPES), token_for(other, scopes=SCOPES)
    endpoint = deploy(platform, token)
    outsider = {"Authorization": f"Bearer {other_token}"}
    assert requests.post(f"{gateway}/e/acme/echo/predict", headers=outsider, timeout=10).status_code == 404
    api = requests.get(f"{platform.url}/api/v1/endpoints/{endpoint['id']}/", headers=outsider, timeout=10)
    assert api.status_code == 404 and api.json()["error"]["code"] == "not_found"
    assert requests.get(f"{platform.url}/api/v1/endpoints/", headers=outsider, timeout=10).json()["count"] == 0
    # A token without the invoke scope is refused; no token at all is 401.
    no_scope = token_for(tenant, scopes=["jobs:read"])
    r = requests.post(f"{gateway}/e/acme/echo/predict", headers={"Authorization": f"Bearer {no_scope}"}, timeout=10)
    assert r.status_code == 403
    assert requests.post(f"{gateway}/e/acme/echo/predict", timeout=10).status_code == 401
    with scopes_disabled():
        assert Endpoint.objects.get(pk=endpoint["id"]).state == Endpoint.State.ACTIVE
