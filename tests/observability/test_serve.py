"""``python -m gpushare.serve``: its settings and the metrics directory it prepares (the server itself runs in
tests/observability/test_readiness.py, tests/api/test_contract.py and tests/admission/test_rate_limit.py)."""

from __future__ import annotations

import os
import tempfile

import pytest
from django.db import connection

from gpushare import serve


def test_the_settings_come_from_the_environment_and_flags_win(monkeypatch):
    monkeypatch.setenv("WEB_BIND", "127.0.0.1:9001")
    monkeypatch.setenv("WEB_CONCURRENCY", "5")
    monkeypatch.setenv("WEB_THREADS", "2")
    args = serve.parser().parse_args([])
    assert (args.bind, args.workers, args.threads, args.backlog) == (("127.0.0.1", 9001), 5, 2, 2048)
    args = serve.parser().parse_args(["--bind", "[::]:8000", "--workers", "1"])
    assert (args.bind, args.workers) == (("::", 8000), 1)


def test_an_idle_thread_is_kept_as_long_as_granian_allows_by_default(monkeypatch):
    monkeypatch.delenv("WEB_THREADS_IDLE_TIMEOUT", raising=False)
    assert serve.parser().parse_args([]).threads_idle_timeout == 600
    monkeypatch.setenv("WEB_THREADS_IDLE_TIMEOUT", "45")
    assert serve.parser().parse_args([]).threads_idle_timeout == 45


def test_the_server_is_given_the_idle_timeout(monkeypatch):
    import granian

    given = {}

    class Recorder:
        def __init__(self, target, **kwargs):
            given.update(kwargs)

        def serve(self):
            pass

    monkeypatch.setattr(granian, "Granian", Recorder)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")  # made and removed by main()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.delenv("WEB_THREADS_IDLE_TIMEOUT", raising=False)
    serve.main(["--bind", "127.0.0.1:9002", "--threads", "3"])
    assert (given["blocking_threads"], given["blocking_threads_idle_timeout"]) == (3, 600)


@pytest.mark.parametrize("value", ["4", "601", "ten"])
def test_an_idle_timeout_out_of_granians_range_is_refused_with_the_rule(capsys, value):
    with pytest.raises(SystemExit):
        serve.parser().parse_args(["--threads-idle-timeout", value])
    assert "expected whole seconds from 5 to 600" in capsys.readouterr().err


@pytest.mark.django_db(transaction=True)
def test_threads_and_their_database_connections_outlive_an_idle_spell(spawn):
    """One worker of four threads, connections kept (the default outside the test settings), two servers:
    granian's shortest idle timeout (5 s) and ours. A burst of concurrent requests starts every thread, each
    with its connection; after 7 s idle the first server has ended all but one thread, so the next burst
    runs on new threads that open new connections; ours serves it on the same ones."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from tests.factories import TenantFactory, token_for
    from tests.processes import process_env

    from .conftest import web_server

    headers = {"Authorization": f"Bearer {token_for(TenantFactory())}"}

    def burst(url: str) -> None:  # tokens checked and lists read, on as many threads as granian starts
        with ThreadPoolExecutor(16) as pool:
            for r in pool.map(lambda _: requests.get(f"{url}/api/v1/jobs/", headers=headers, timeout=30), range(64)):
                assert r.status_code == 200

    def backends(name: str) -> set[int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [name])
            return {pid for (pid,) in cursor.fetchall()}

    servers = {}
    for name, timeout in (("gpushare-web-reaped", "5"), ("gpushare-web-kept", None)):
        env = process_env({"GPUSHARE_DB_CONN_MAX_AGE": "", "WEB_THREADS": "4"})
        env["DATABASE_URL"] += f"?application_name={name}"
        env.pop("WEB_THREADS_IDLE_TIMEOUT", None)
        if timeout:
            env["WEB_THREADS_IDLE_TIMEOUT"] = timeout
        servers[name] = url = web_server(spawn, env, workers=1)
        burst(url)
    before = {name: backends(name) for name in servers}
    assert all(len(pids) > 1 for pids in before.values()), before  # the burst started more than one thread
    time.sleep(7)
    for url in servers.values():
        burst(url)
    opened = {name: backends(name) - before[name] for name in servers}
    assert opened["gpushare-web-kept"] == set()
    assert opened["gpushare-web-reaped"], "granian's threads were not ended: the test shows nothing"


def test_a_bind_without_a_port_is_refused_with_the_rule(capsys):
    with pytest.raises(SystemExit):
        serve.parser().parse_args(["--bind", "localhost"])
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_an_operators_metrics_directory_is_emptied_and_kept(monkeypatch, tmp_path):
    given = tmp_path / "metrics"
    given.mkdir()
    (given / "counter_123.db").write_bytes(b"stale")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    assert serve.metrics_dir() is None  # not ours to remove at exit
    assert given.is_dir() and not any(given.iterdir())


def test_without_one_a_fresh_directory_is_made_for_the_workers(monkeypatch):
    # Set, then removed: monkeypatch then puts back what was there before (nothing), not the directory made
    # here (every process this test session starts afterwards would inherit a directory that is gone).
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    made = serve.metrics_dir()
    try:
        assert made and os.environ["PROMETHEUS_MULTIPROC_DIR"] == made and os.path.isdir(made)
    finally:
        os.rmdir(made)


def test_the_servers_own_lines_go_through_the_platforms_handler():
    config = serve.log_config()
    assert config["loggers"]["_granian"]["handlers"] == ["console"]
    assert config["loggers"]["granian.access"]["level"] == "WARNING"  # gpushare.request logs each request


def test_the_directory_made_by_a_test_does_not_outlive_it():
    """Runs after the one above (file order): its environment is as it was before it."""
    assert not os.environ.get("PROMETHEUS_MULTIPROC_DIR", "").startswith(
        os.path.join(tempfile.gettempdir(), "gpushare-web")
    )
