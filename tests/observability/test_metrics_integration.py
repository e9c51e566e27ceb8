"""Every metrics endpoint serves its named series with the right labels after real work:
a job submitted through the API, placed by the worker, run and metered by an agent on
simulated GPUs (worker, beat, agent /metrics), and a request through the endpoint
gateway to a real replica (gateway /metrics)."""

from __future__ import annotations

import sys

import pytest
import requests

from tests.endpoints.test_endpoints_integration import SCOPES, deploy
from tests.factories import TenantFactory, token_for, wait_for
from tests.processes import free_port, process_env

from .conftest import beat_process
from .helpers import scrape, status, value

pytestmark = pytest.mark.integration

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 4: pass\nprint('done')"
METRICS_TOKEN = "scrape-token-0123456789abcdef"


def test_a_real_job_shows_in_the_agent_worker_and_beat_metrics(
    platform, agent_factory, celery_worker_process, spawn, tmp_path
):
    agent_port = free_port()
    agent = agent_factory("obs-node", extra=["--metrics-port", str(agent_port)])
    agent_url = f"http://127.0.0.1:{agent_port}"
    _, beat_url = beat_process(spawn, tmp_path)
    tenant = TenantFactory(slug="obs-tenant")
    session = platform.session_for(tenant)

    submitted = session.post(
        f"{platform.url}/api/v1/jobs/",
        json={"kind": "training", "gpus": 1, "command": [sys.executable, "-c", BUSY]},
        timeout=10,
    )
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]

    # While it runs: the job's series on the agent, with job and tenant labels, on its GPU.
    def job_series():
        samples = scrape(agent_url)
        sm = value(samples, "gpushare_job_sm_util_percent", job=job_id, tenant="obs-tenant")
        return samples if sm is not None and sm > 10 else None

    samples = wait_for(job_series, timeout=45, what="the running job's series on the agent")
    job = session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=10).json()
    uuid = job["gpu_uuids"][0]
    job_labels = {"job": job_id, "tenant": "obs-tenant", "UUID": uuid, "Hostname": "obs-node", "mode": "dedicated"}
    assert value(samples, "gpushare_job_sm_share", **job_labels) == 1.0
    assert value(samples, "gpushare_job_fb_used_mib", **job_labels) > 0
    # Per GPU, dcgm-exporter's names and labels: all four simulated GPUs, the job's one busy.
    for name in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    ):
        assert len(samples.get(name, [])) == 4, name
    model = job["gpu_model"] or next(  # placement picks the model (the cheapest that fits) when the job names none
        labels["modelName"] for labels, _ in samples["DCGM_FI_DEV_GPU_UTIL"] if labels.get("UUID") == uuid
    )
    assert model in ("H100-80GB", "L4-24GB")
    assert value(samples, "DCGM_FI_DEV_GPU_UTIL", UUID=uuid, Hostname="obs-node", modelName=model) > 10
    assert value(samples, "DCGM_FI_DEV_XID_ERRORS", UUID=uuid) == 0
    assert value(samples, "gpushare_agent_broker_connected", Hostname="obs-node") == 1
    assert value(samples, "gpushare_agent_outbox_messages", Hostname="obs-node") is not None
    assert value(samples, "gpushare_agent_jobs_running", Hostname="obs-node") == 1
    wait_for(
        lambda: (
            (value(scrape(agent_url), "gpushare_job_energy_joules_total", job=job_id, tenant="obs-tenant") or 0) > 0
        ),
        timeout=20,
        what="energy attributed to the job",
    )

    wait_for(
        lambda: session.get(f"{platform.url}/api/v1/jobs/{job_id}/", timeout=10).json()["state"] == "succeeded",
        timeout=60,
        what="the job to succeed",
    )
    # Gone from the agent once it ended.
    wait_for(
        lambda: value(scrape(agent_url), "gpushare_job_sm_util_percent", job=job_id, UUID=uuid) is None,
        timeout=20,
        what="the job's series to go",
    )

    # The worker: task outcomes, the pass that placed it, the windows it stored and their lag.
    def worker_counted():
        s = scrape(celery_worker_process.ops_url)
        ok = (
            (value(s, "gpushare_celery_tasks_total", task="scheduler.pass", outcome="succeeded") or 0) >= 1
            and (value(s, "gpushare_celery_tasks_total", task="agents.job_exited", outcome="succeeded") or 0) >= 1
            and (value(s, "gpushare_scheduler_placements_total") or 0) >= 1
            and (value(s, "gpushare_usage_windows_total", outcome="stored") or 0) >= 1
        )
        return s if ok else None

    worker = wait_for(worker_counted, timeout=30, what="the worker's task metrics")
    assert value(worker, "gpushare_celery_task_seconds_count", task="scheduler.pass") >= 1
    assert value(worker, "gpushare_scheduler_pass_seconds_count") >= 1
    assert value(worker, "gpushare_scheduler_pass_placements_sum") >= 1
    assert value(worker, "gpushare_usage_ingest_lag_seconds_count") >= 1
    assert value(worker, "gpushare_usage_ingest_lag_seconds_bucket", le="+Inf") >= 1
    assert status(celery_worker_process.ops_url, "/readyz") == 200

    # Beat: the depth of every queue, the node's own included.
    beat = wait_for(
        lambda: (s := scrape(beat_url)) and "gpushare_celery_queue_messages" in s and s, timeout=20, what="queue depth"
    )
    assert value(beat, "gpushare_celery_queue_messages", queue="platform") is not None
    assert value(beat, "gpushare_celery_queue_messages", queue="node.obs-node") is not None
    wait_for(lambda: status(beat_url, "/readyz") == 200, timeout=30, what="beat ready")
    agent.stop()


def test_a_request_through_the_gateway_shows_in_its_metrics(platform, agent_factory, spawn):
    agent_factory("gw-node", gpus="sim:1xL4-24GB")
    tenant = TenantFactory(slug="acme")
    token = token_for(tenant, scopes=SCOPES)
    deploy(platform, token, min_replicas=0, max_replicas=1)
    port = free_port()
    proc, log_path = spawn(
        "gateway",
        [sys.executable, "-m", "endpoints", "--port", str(port), "--refresh", "0.25", "--cold-start-timeout", "90"],
        process_env({"GPUSHARE_METRICS_TOKEN": METRICS_TOKEN}),
    )
    gateway = f"http://127.0.0.1:{port}"
    wait_for(lambda: status(gateway, "/healthz") == 200 or proc.poll() is not None, timeout=30, what="the gateway")
    auth = {"Authorization": f"Bearer {token}"}

    answer = requests.post(f"{gateway}/e/acme/echo/predict", data=b"hi", headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text
    missing = requests.post(f"{gateway}/e/acme/no-such-endpoint/x", data=b"hi", headers=auth, timeout=30)
    assert missing.status_code == 404

    # The scrape needs the token.
    assert requests.get(f"{gateway}/metrics", timeout=10).status_code == 401
    wrong = requests.get(f"{gateway}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    samples = scrape(gateway, METRICS_TOKEN)
    labels = {"tenant": "acme", "endpoint": "echo"}
    assert value(samples, "gpushare_gateway_requests_total", code="200", **labels) == 1
    assert value(samples, "gpushare_gateway_request_seconds_count", **labels) == 1
    assert value(samples, "gpushare_gateway_request_seconds_sum", **labels) > 0
    assert value(samples, "gpushare_gateway_inflight_requests", **labels) == 0
    assert value(samples, "gpushare_gateway_replicas_ready", **labels) == 1
    assert value(samples, "gpushare_gateway_replicas", state="ready", **labels) == 1
    assert value(samples, "gpushare_gateway_queued_requests", **labels) == 0
    assert value(samples, "gpushare_gateway_errors_total", **labels) is None
    # A name that is not deployed gets no series of its own.
    assert value(samples, "gpushare_gateway_requests_total", code="404", tenant="", endpoint="") == 1
    assert not [s for s, _ in samples["gpushare_gateway_requests_total"] if s["endpoint"] == "no-such-endpoint"]
    assert status(gateway, "/readyz") == 200
