"""``python -m gpushare.serve``: its settings and the metrics directory it prepares (the server itself runs in
tests/observability/test_readiness.py, tests/api/test_contract.py and tests/admission/test_rate_limit.py)."""

from __future__ import annotations

import os
import tempfile

import pytest

from gpushare import serve


def test_the_settings_come_from_the_environment_and_flags_win(monkeypatch):
    monkeypatch.setenv("WEB_BIND", "127.0.0.1:9001")
    monkeypatch.setenv("WEB_CONCURRENCY", "5")
    monkeypatch.setenv("WEB_THREADS", "2")
    args = serve.parser().parse_args([])
    assert (args.bind, args.workers, args.threads, args.backlog) == (("127.0.0.1", 9001), 5, 2, 2048)
    args = serve.parser().parse_args(["--bind", "[::]:8000", "--workers", "1"])
    assert (args.bind, args.workers) == (("::", 8000), 1)


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
