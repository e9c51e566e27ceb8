"""The Python SDK (gpushare_client) against a live server: typed answers and errors, idempotent
submission, pagination, waiting and logs with a real agent, endpoints, usage, and retries
that honour Retry-After."""

from __future__ import annotations

import subprocess
import sys
import time
from decimal import Decimal

import pytest
import urllib3
from django_scopes import scopes_disabled

from gpushare_client import (
    BadRequest,
    Client,
    Conflict,
    Finished,
    Job,
    LogText,
    NotFound,
    RateLimited,
    StateChanged,
    Unauthenticated,
)
from scheduler.models import Job as JobRow
from tests.factories import TenantFactory, platform_rules_seed, token_for

from .stubs import Stub


@pytest.fixture(autouse=True)
def _generous_rate_limit(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}


@pytest.fixture
def sdk(live_server, transactional_db):
    platform_rules_seed()
    tenant = TenantFactory(slug="sdk")
    return Client(live_server.url, token_for(tenant)), tenant


def test_submit_is_typed_and_idempotent(sdk):
    client, tenant = sdk
    first = client.submit(["python", "train.py"], gpus=2, name="nightly", idempotency_key="ci-42-train")
    assert first.created is True and isinstance(first.job, Job)
    job = first.job
    assert (job.kind, job.gpus, job.state, job.name, job.command) == (
        "training",
        2,
        "queued",
        "nightly",
        ("python", "train.py"),
    )
    assert job.cost == Decimal(0) and isinstance(job.cost, Decimal) and job.submitted_at.tzinfo is not None
    again = client.submit(["python", "train.py"], gpus=2, name="nightly", idempotency_key="ci-42-train")
    assert again.created is False and again.job.id == job.id
    with pytest.raises(Conflict) as conflict:
        client.submit(["python", "other.py"], gpus=2, idempotency_key="ci-42-train")
    assert conflict.value.code == "conflict" and conflict.value.status == 409
    slice_job = client.submit("echo hi", gpus=0.25).job  # a string runs under /bin/sh -c; a slice is inference
    assert (slice_job.kind, slice_job.command) == ("inference", ("/bin/sh", "-c", "echo hi"))
    with scopes_disabled():
        assert JobRow.objects.filter(tenant=tenant).count() == 2


def test_errors_carry_the_api_code_and_fields(sdk, live_server):
    client, _ = sdk
    with pytest.raises(BadRequest) as bad:
        client.submit(["x"], gpus=0.3)
    assert bad.value.code == "invalid" and "gpus" in bad.value.fields
    assert str(bad.value).count("0.125") == 1  # the message once, not repeated from the fields
    with pytest.raises(NotFound) as missing:
        client.job(99999999)
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    with pytest.raises(Unauthenticated):
        Client(live_server.url, "gps_nope", retries=0).job(1)
    other = Client(live_server.url, token_for(TenantFactory(slug="other")))
    mine = client.submit(["x"]).job
    with pytest.raises(NotFound):
        other.job(mine.id)  # another tenant's job looks missing
    with pytest.raises(NotFound):
        other.cancel(mine.id)


def test_list_follows_every_page_and_cancel(sdk):
    client, _ = sdk
    ids = [client.submit(["x", str(i)], name=f"batch-{i}").job.id for i in range(5)]
    listed = list(client.jobs(page_size=2))
    assert [j.id for j in listed] == ids[::-1]  # newest first, across three pages
    assert len(list(client.jobs(page_size=2, limit=3))) == 3
    assert [j.id for j in client.jobs(name="batch-3")] == [ids[3]]
    cancelled = client.cancel(ids[0])
    assert cancelled.state == "cancelled" and cancelled.finished
    assert [j.id for j in client.jobs(state="cancelled")] == [ids[0]]
    assert {j.id for j in client.jobs(state=["queued", "cancelled"])} == set(ids)


def test_endpoints_and_usage(sdk):
    client, _ = sdk
    created = client.endpoint_create({"name": "llm", "command": ["python", "serve.py"], "gpus": 0.25})
    assert (created.name, created.version, created.min_replicas) == ("llm", 1, 0)
    assert [e.id for e in client.endpoints(name="llm")] == [created.id]
    scaled = client.endpoint_scale(created.id, min_replicas=0, max_replicas=3)
    assert scaled.max_replicas == 3
    updated = client.endpoint_update(created.id, {"env": {"MODEL": "b"}})
    assert updated.version == 2
    client.endpoint_delete(created.id)
    assert client.endpoints(name="llm") == []
    usage = client.usage(group_by="day")
    assert usage.group_by == "day" and usage.rows == () and usage.cost == 0
    assert "headroom" in client.quota()
    assert client.estimate(gpus=1)["results"]


def test_retries_honour_retry_after_on_503_and_429(sdk):
    client, _ = sdk
    stub = Stub(client.config.url, busy=2, busy_status=503, retry_after="1")
    try:
        patient = Client(stub.url, client.config.token, retries=3, backoff=0.01)
        started = time.monotonic()
        job = patient.submit(["x"], idempotency_key="retried").job
        elapsed = time.monotonic() - started
        posts = [s for s in stub.seen if s["method"] == "POST"]
        assert len(posts) == 3  # two 503s, then the platform
        assert posts[1]["at"] - posts[0]["at"] >= 0.95 and elapsed >= 1.9  # waited Retry-After each time
        assert {p["headers"]["Idempotency-Key"] for p in posts} == {"retried"}  # the same key on every try
        assert client.job(job.id).id == job.id

        stub.busy, stub.busy_status, stub.retry_after = -1, 429, "1"
        stub.seen.clear()
        brief = Client(stub.url, client.config.token, retries=1, backoff=0.01)
        with pytest.raises(RateLimited) as limited:
            brief.job(job.id)
        assert limited.value.code == "rate_limited" and limited.value.retry_after == 1.0
        assert len(stub.seen) == 2  # one retry, then the typed error
    finally:
        stub.close()


def test_job_arrays(sdk):
    """Job arrays (issue #19's API): ``array="1-3"`` sends ``{"range": "1-3"}``, ``array=4`` ``{"count": 4}``."""
    client, _ = sdk
    submitted = client.submit(["python", "sweep.py"], array="1-3", name="sweep", idempotency_key="sweep-1")
    assert submitted.created and submitted.array.task_count == 3
    tasks = list(client.jobs(array=submitted.array.id))
    assert len(tasks) == 3 and {t.name for t in tasks} <= {"sweep", *(f"sweep[{i}]" for i in range(1, 4))}
    again = client.submit(["python", "sweep.py"], array="1-3", name="sweep", idempotency_key="sweep-1")
    assert again.created is False and again.array.id == submitted.array.id
    counted = client.submit(["python", "sweep.py"], array=4)
    assert counted.array.task_count == 4
    with pytest.raises(ValueError):
        counted.job  # noqa: B018  (an array has no single job)


@pytest.mark.integration
def test_wait_watch_and_stream_logs_with_a_real_agent(platform, agent_factory):
    agent_factory("node-1")
    tenant = TenantFactory(slug="sdk-run")
    client = Client(platform.url, token_for(tenant))
    script = "import time\nfor i in range(3):\n    print(f'step {i}', flush=True)\n    time.sleep(0.3)\n"
    job = client.submit([sys.executable, "-c", script], name="watched").job
    events = list(client.watch(job.id, logs=True, poll_interval=0.2))
    assert isinstance(events[0], StateChanged) and isinstance(events[-1], Finished)
    assert events[-1].job.state == "succeeded" and events[-1].job.exit_code == 0
    assert "".join(e.text for e in events if isinstance(e, LogText)) == "step 0\nstep 1\nstep 2\n"
    assert [e.job.state for e in events if isinstance(e, StateChanged)][-1] == "succeeded"
    assert "".join(client.stream_logs(job.id, poll_interval=0.2)) == "step 0\nstep 1\nstep 2\n"

    failing = client.submit([sys.executable, "-c", "import sys; sys.exit(4)"]).job
    finished = client.wait(failing.id, poll_interval=0.2, timeout=60)
    assert (finished.state, finished.exit_code) == ("failed", 4)


def test_the_sdk_and_cli_import_no_django():
    """Nor requests: the SDK's HTTP is urllib3's (requests on top of it cost ~0.4 ms of CPU a call)."""
    code = (
        "import sys; import gpushare_client, gpushare_client.cli; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'rest_framework', 'celery', 'gpushare', 'requests'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_environment_proxy_is_used_unless_the_host_is_excluded(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert type(Client("http://gpushare.example", "t").http) is urllib3.PoolManager
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    proxied = Client("https://gpushare.example", "t").http
    assert isinstance(proxied, urllib3.ProxyManager) and proxied.proxy.host == "proxy.example"
    assert type(Client("http://gpushare.example", "t").http) is urllib3.PoolManager  # no HTTP_PROXY
    monkeypatch.setenv("NO_PROXY", "gpushare.example")
    assert type(Client("https://gpushare.example", "t").http) is urllib3.PoolManager
