"""The Grafana dashboards in deploy/grafana are what their generator writes, and every series
their queries read is one the running code exports (platform, gateway, agent)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
SERIES = re.compile(r"\b(?:gpushare_|DCGM_|django_)[A-Za-z0-9_]+")


def generator():
    spec = importlib.util.spec_from_file_location("dashboards", GRAFANA / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def names_of(registry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


def exported_series() -> set[str]:
    from prometheus_client import REGISTRY, CollectorRegistry

    import gpushare.observability.metrics as platform
    from agents.agent.metrics import AgentMetrics
    from endpoints.gateway_metrics import GatewayMetrics

    names = names_of(REGISTRY) | {"gpushare_celery_queue_messages"}  # read from the broker at scrape time
    names |= names_of(GatewayMetrics(SimpleNamespace(table={}, traffic={})).registry)
    agent = SimpleNamespace(
        config=SimpleNamespace(node="n", sample_interval_s=1.0),
        gpus={},
        jobs={},
        link=SimpleNamespace(connected=True),
        backend=SimpleNamespace(name="sim"),
        spool=SimpleNamespace(pending=lambda: 0),
    )
    metrics = AgentMetrics(agent)
    registry = CollectorRegistry()
    registry.register(metrics)
    names |= names_of(registry)
    assert platform.TASKS._name in names
    return names


def test_the_files_are_what_the_generator_writes():
    for filename, text in generator().render().items():
        assert (GRAFANA / filename).read_text() == text, f"run python deploy/grafana/dashboards.py ({filename})"


def test_every_query_reads_a_series_we_export():
    exported = exported_series()
    for filename in ("fleet.json", "tenant.json"):
        board = json.loads((GRAFANA / filename).read_text())
        exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        assert len(exprs) >= 10
        used = {name for expr in exprs for name in SERIES.findall(expr)}
        assert used and used <= exported, sorted(used - exported)
    tenant = json.loads((GRAFANA / "tenant.json").read_text())
    assert tenant["templating"]["list"][0]["name"] == "tenant"
    assert all('tenant="$tenant"' in t["expr"] for p in tenant["panels"] for t in p.get("targets", []))
