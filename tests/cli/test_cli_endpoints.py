"""``gpushare endpoint ...`` run as a process against a live server and the real API.

No agent runs here: replicas are started by calling the autoscaling service in the
test, and their "health check" and log lines are written to the database, which is
what the gateway and the agent would do.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import pytest
from django_scopes import scopes_disabled

from endpoints.models import Endpoint, Replica
from endpoints.services import endpoint_autoscale, endpoint_update
from gpushare_client import Conflict, NotFound
from gpushare_client import Endpoint as ApiEndpoint
from gpushare_client.cli import run_cli as cli_in_process
from gpushare_client.cli.app import EXIT_API, EXIT_TIMEOUT, EXIT_USAGE, State
from scheduler.models import JobLogChunk
from scheduler.services import job_cancel
from tests.cli.test_cli import ROOT, run_cli
from tests.factories import TenantFactory, platform_rules_seed, token_for, wait_for


@pytest.fixture(autouse=True)
def _generous_rate_limit(settings):
    """The CLI polls every 0.3 s here: keep the per-token limit out of the way."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"token": "100000/min"}}


@pytest.fixture
def acme(live_server, transactional_db):
    """(url, token, tenant) of a tenant with the platform's priority classes and prices seeded."""
    platform_rules_seed()
    tenant = TenantFactory(slug="acme")
    return live_server.url, token_for(tenant), tenant


def endpoint_of(tenant, name: str) -> Endpoint:
    with scopes_disabled():
        return Endpoint.objects.get(tenant=tenant, name=name, state=Endpoint.State.ACTIVE)


def replicas_start(tenant, name: str, count: int) -> list[Replica]:
    """Set min_replicas to ``count`` and run an autoscaling pass: ``count`` replicas (queued jobs) exist."""
    with scopes_disabled():
        endpoint = endpoint_of(tenant, name)
        endpoint_update(endpoint=endpoint, user=None, changes={"min_replicas": count})
        endpoint_autoscale(endpoint_id=endpoint.pk)
        return list(Replica.objects.filter(endpoint=endpoint).exclude(state=Replica.State.STOPPED).order_by("pk"))


def cli_env(url: str, token: str) -> dict:
    return {
        "PATH": "/usr/bin:/bin",
        "GPUSHARE_URL": url,
        "GPUSHARE_TOKEN": token,
        "GPUSHARE_POLL_INTERVAL": "0.3",
        "XDG_CONFIG_HOME": str(ROOT / "var" / "no-config"),
    }


def cli_start(url: str, token: str, *args: str, stdin=None) -> subprocess.Popen:
    """The CLI as a process that keeps running while the test changes the platform under it."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare_client", *args],
        cwd=ROOT,
        env=cli_env(url, token),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def log_append(replica: Replica, offset: int, text: str) -> None:
    with scopes_disabled():
        JobLogChunk.objects.create(tenant=replica.tenant, job=replica.job, offset=offset, data=text.encode())


def test_deploy_creates_then_updates_with_a_rolling_version(acme, tmp_path):
    url, token, tenant = acme
    created = run_cli(
        url, token, "endpoint", "deploy", "echo", "--gpus", "0.5", "--max", "3", "--env", "MODEL=a",
        "--", "python", "serve.py", "--port", "$PORT",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert "endpoint echo created (version 1)" in created.stdout
    assert "/e/acme/echo/" in created.stdout
    endpoint = endpoint_of(tenant, "echo")
    assert endpoint.command == ["python", "serve.py", "--port", "$PORT"]  # the command's own flags are its own
    assert (endpoint.gpu_milli, endpoint.max_replicas, endpoint.env, endpoint.version) == (500, 3, {"MODEL": "a"}, 1)

    # A second deploy of the same name changes what replicas run: a rolling update to version 2.
    updated = run_cli(url, token, "endpoint", "deploy", "echo", "--env", "MODEL=b")
    assert updated.returncode == 0, updated.stderr
    assert "rolling out version 2" in updated.stdout
    endpoint = endpoint_of(tenant, "echo")
    assert (endpoint.version, endpoint.env, endpoint.gpu_milli) == (2, {"MODEL": "b"}, 500)  # the rest is kept
    with scopes_disabled():
        assert Endpoint.objects.filter(tenant=tenant).count() == 1

    # Bounds only: no new version.
    bounds = run_cli(url, token, "endpoint", "deploy", "echo", "--concurrency", "8", "--idle-timeout", "30", "--json")
    assert bounds.returncode == 0, bounds.stderr
    shown = json.loads(bounds.stdout)
    assert (shown["version"], shown["concurrency_target"], shown["idle_timeout_seconds"]) == (2, 8, 30)

    # From a file, with the flags over it; a new endpoint defaults to a quarter GPU.
    spec = tmp_path / "llm.yaml"
    spec.write_text("command: python serve.py\nmin_replicas: 0\nmax_replicas: 2\nenv: {MODEL: big}\n")
    from_file = run_cli(url, token, "endpoint", "deploy", "llm", "-f", str(spec), "--env", "DEBUG=1", "--wait")
    assert from_file.returncode == 0, from_file.stderr
    assert "scales from zero" in from_file.stderr  # min 0 and --wait: nothing to wait for
    llm = endpoint_of(tenant, "llm")
    assert llm.command == ["/bin/sh", "-c", "python serve.py"]
    assert (llm.gpu_milli, llm.max_replicas, llm.env) == (250, 2, {"MODEL": "big", "DEBUG": "1"})


def test_deploy_wait_returns_once_a_replica_of_the_new_version_is_ready(acme):
    url, token, tenant = acme
    quick = run_cli(url, token, "endpoint", "deploy", "svc", "--min", "1", "--wait", "--timeout", "1", "--", "x")
    assert quick.returncode == EXIT_TIMEOUT, quick.stderr  # nothing starts replicas here
    assert "no replica of version 1 ready after --timeout 1s" in quick.stderr

    waiting = cli_start(url, token, "endpoint", "deploy", "svc", "--env", "V=2", "--wait", "--timeout", "60")
    try:
        wait_for(lambda: endpoint_of(tenant, "svc").version == 2, what="the rolling update")
        (replica,) = replicas_start(tenant, "svc", 1)
        time.sleep(1)
        assert waiting.poll() is None, "a starting replica is not a ready one"
        with scopes_disabled():
            Replica.objects.filter(pk=replica.pk).update(state=Replica.State.READY)  # the gateway's health check
        out, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, err
    assert f"replica {replica.pk} of version 2 is ready" in err
    assert "rolling out version 2" in out


def test_list_shows_the_tenants_endpoints(acme):
    url, token, tenant = acme
    for name, gpus in (("alpha", "0.25"), ("beta-model", "1")):
        assert run_cli(url, token, "endpoint", "deploy", name, "--gpus", gpus, "--max", "2", "--", "x").returncode == 0
    other = TenantFactory(slug="other")
    assert run_cli(url, token_for(other), "endpoint", "deploy", "theirs", "--", "x").returncode == 0
    replicas_start(tenant, "alpha", 2)

    listed = run_cli(url, token, "endpoint", "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["NAME", "VERSION", "READY/LIVE", "MIN-MAX", "GPUS", "COST", "URL"]
    as_json = json.loads(run_cli(url, token, "endpoint", "list", "--json").stdout)
    cost = f"${as_json[0]['cost']}"  # the API's exact figure, as it is
    assert [row.split() for row in rows] == [
        ["alpha", "1", "0/2", "2-2", "0.25", cost, "/e/acme/alpha/"],
        ["beta-model", "1", "0/0", "0-2", "1", cost, "/e/acme/beta-model/"],
    ]
    assert [e["name"] for e in as_json] == ["alpha", "beta-model"]


def test_scale_sets_the_bounds(acme):
    url, token, tenant = acme
    assert run_cli(url, token, "endpoint", "deploy", "echo", "--max", "2", "--", "x").returncode == 0
    scaled = run_cli(url, token, "endpoint", "scale", "echo", "--min", "1", "--max", "4")
    assert scaled.returncode == 0, scaled.stderr
    assert scaled.stdout.strip() == "endpoint echo: min 1, max 4 (was 0-2)"
    endpoint = endpoint_of(tenant, "echo")
    assert (endpoint.min_replicas, endpoint.max_replicas, endpoint.version) == (1, 4, 1)

    only_max = run_cli(url, token, "endpoint", "scale", "echo", "--max", "6")  # the other bound is kept
    assert only_max.returncode == 0 and "min 1, max 6 (was 1-4)" in only_max.stdout
    refused = run_cli(url, token, "endpoint", "scale", "echo", "--min", "5", "--max", "2")
    assert refused.returncode == EXIT_API and "min_replicas must not exceed max_replicas" in refused.stderr
    assert run_cli(url, token, "endpoint", "scale", "echo").returncode == EXIT_USAGE


def test_delete_asks_on_a_terminal_and_refuses_without_one(acme):
    url, token, tenant = acme
    assert run_cli(url, token, "endpoint", "deploy", "echo", "--", "x").returncode == 0

    refused = run_cli(url, token, "endpoint", "delete", "echo")  # stdin is not a terminal here
    assert refused.returncode == EXIT_USAGE
    assert "not deleting endpoint echo without --yes" in refused.stderr
    assert endpoint_of(tenant, "echo").state == Endpoint.State.ACTIVE

    assert on_a_terminal(url, token, "n\n", "endpoint", "delete", "echo")[0] == EXIT_USAGE
    assert endpoint_of(tenant, "echo").state == Endpoint.State.ACTIVE
    code, err = on_a_terminal(url, token, "y\n", "endpoint", "delete", "echo")
    assert code == 0 and "delete endpoint echo" in err
    with scopes_disabled():
        assert Endpoint.objects.get(tenant=tenant, name="echo").state == Endpoint.State.DELETED

    assert run_cli(url, token, "endpoint", "deploy", "echo", "--", "x").returncode == 0  # the name is free again
    deleted = run_cli(url, token, "endpoint", "delete", "echo", "--yes")
    assert deleted.returncode == 0 and "endpoint echo deleted" in deleted.stdout
    with scopes_disabled():
        assert not Endpoint.objects.filter(tenant=tenant, state=Endpoint.State.ACTIVE).exists()


def on_a_terminal(url: str, token: str, answer: str, *args: str) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as stdin, type ``answer``; (exit code, stderr)."""
    leader, follower = pty.openpty()
    proc = cli_start(url, token, *args, stdin=follower)
    os.close(follower)
    try:
        os.write(leader, answer.encode())
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        os.close(leader)
    return proc.returncode, err


def test_unknown_names_bad_input_and_another_tenants_endpoint(acme):
    url, token, tenant = acme
    other = TenantFactory(slug="other")
    assert run_cli(url, token_for(other), "endpoint", "deploy", "theirs", "--", "x").returncode == 0
    for args in (("logs", "ghost"), ("scale", "ghost", "--max", "2"), ("delete", "ghost", "--yes")):
        done = run_cli(url, token, "endpoint", *args)
        assert done.returncode == EXIT_API and "no endpoint named ghost" in done.stderr, done.stderr
    theirs = run_cli(url, token, "endpoint", "delete", "theirs", "--yes")  # another tenant's name: unknown here
    assert theirs.returncode == EXIT_API and "no endpoint named theirs" in theirs.stderr
    with scopes_disabled():
        assert Endpoint.objects.get(name="theirs").state == Endpoint.State.ACTIVE

    bad_slice = run_cli(url, token, "endpoint", "deploy", "echo", "--gpus", "0.3", "--", "x")
    assert bad_slice.returncode == EXIT_USAGE, bad_slice.stderr  # refused before any request, once
    assert bad_slice.stderr.count("0.3 is neither 1-8 whole GPUs nor a shared slice") == 1
    bad_name = run_cli(url, token, "endpoint", "deploy", "Not A Name", "--", "x")
    assert bad_name.returncode == EXIT_API and "name must be an endpoint name" in bad_name.stderr
    no_command = run_cli(url, token, "endpoint", "deploy", "echo")
    assert no_command.returncode == EXIT_USAGE and "no command" in no_command.stderr
    with scopes_disabled():
        assert not Endpoint.objects.filter(tenant=tenant).exists()


def test_logs_prints_each_replica_and_follows_new_ones_until_they_end(acme):
    url, token, tenant = acme
    assert run_cli(url, token, "endpoint", "deploy", "echo", "--max", "3", "--", "x").returncode == 0
    assert run_cli(url, token, "endpoint", "logs", "echo").returncode == 0  # no replicas yet: nothing to print
    first, second = replicas_start(tenant, "echo", 2)
    log_append(first, 0, "loading\nready\n")
    log_append(second, 0, "loading\npartial")

    both = run_cli(url, token, "endpoint", "logs", "echo")
    assert both.returncode == 0, both.stderr
    assert both.stdout.splitlines() == [
        f"[replica {first.pk}] loading",
        f"[replica {first.pk}] ready",
        f"[replica {second.pk}] loading",
        f"[replica {second.pk}] partial",
    ]
    one = run_cli(url, token, "endpoint", "logs", "echo", "--replica", str(second.pk))
    assert one.returncode == 0 and one.stdout == "loading\npartial"  # one replica: its log as it is
    missing = run_cli(url, token, "endpoint", "logs", "echo", "--replica", "999999")
    assert missing.returncode == EXIT_API and "no live replica 999999" in missing.stderr

    following = cli_start(url, token, "endpoint", "logs", "echo", "-f")
    try:
        time.sleep(1.5)
        log_append(second, len("loading\npartial"), " line\n")
        third = replicas_start(tenant, "echo", 3)[2]  # scaled out while following
        log_append(third, 0, "new replica\n")
        time.sleep(1.5)
        assert following.poll() is None, "it follows while the replicas run"
        with scopes_disabled():
            for replica in (first, second, third):
                job_cancel(job=replica.job)
        out, err = following.communicate(timeout=60)  # the logs settle 3 s after the jobs end
    finally:
        following.kill()
    assert following.returncode == 0, err
    lines = out.splitlines()
    assert f"[replica {second.pk}] partial line" in lines
    assert f"[replica {third.pk}] new replica" in lines
    assert lines.count(f"[replica {first.pk}] ready") == 1


class LostAnswers:
    """A client whose first create and delete reached the platform but lost their answers: the
    retry then finds the endpoint already there (409) or already gone (404)."""

    def __init__(self):
        self.existing: dict | None = None
        self.calls: list[str] = []

    def endpoints(self, *, name=None):
        return [self.existing] if self.existing else []

    def endpoint_create(self, body):
        self.calls.append("create")
        raw = {"id": 7, "name": body["name"], "version": 1, "url": "/e/t/echo/", "state": "active", "gpus": 0.25}
        self.existing = ApiEndpoint.from_api(raw | {"min_replicas": 0, "max_replicas": 1, "replicas": []})
        raise Conflict("an endpoint named 'echo' already exists", status=409, code="conflict")

    def endpoint_update(self, endpoint_id, changes):
        self.calls.append(f"update {endpoint_id}")
        return self.existing

    def endpoint_delete(self, endpoint_id):
        self.calls.append(f"delete {endpoint_id}")
        raise NotFound("Not found.", status=404, code="not_found")


def test_a_retried_create_or_delete_is_taken_as_done(capsys, monkeypatch):
    client = LostAnswers()
    monkeypatch.setattr(State, "client", lambda self: client)
    assert cli_in_process(["endpoint", "deploy", "echo", "--", "x"]) == 0
    assert client.calls == ["create", "update 7"]  # the 409 became an update of the one the first attempt made
    assert "endpoint echo updated (still version 1" in capsys.readouterr().out
    assert cli_in_process(["endpoint", "delete", "echo", "--yes"]) == 0
    assert client.calls[-1] == "delete 7" and "endpoint echo deleted" in capsys.readouterr().out
