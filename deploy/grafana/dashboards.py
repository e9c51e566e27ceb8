# ruff: noqa: E501 - a PromQL query reads best on one line
"""Writes the Grafana dashboards in this folder: ``python deploy/grafana/dashboards.py``.

fleet.json   the operator's view: GPUs (dcgm-exporter names, so NVIDIA's own exporter
             fills the same panels), agents, API, Celery, scheduling, metering, gateway.
tenant.json  one tenant (the ``tenant`` variable): its jobs' SM use, memory, energy and
             GPU share, and its inference endpoints through the gateway.

Both read a Prometheus data source chosen at import (``DS_PROMETHEUS``). The panels'
queries use only series gpushare exports (tests/deploy/test_grafana.py checks every name
against the running code's registries, and that these files are what this script writes).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


class Board:
    def __init__(self, uid: str, title: str, description: str, variables: list[dict] | None = None):
        self.uid, self.title, self.description = uid, title, description
        self.variables = variables or []
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
             "id": len(self.panels) + 1, "panels": []}
        )  # fmt: skip
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.x = 0
            self.y += 8

    def panel(self, title: str, exprs: list[tuple[str, str]], *, unit: str = "short", kind: str = "timeseries",
              width: int = 8, description: str = "") -> None:  # fmt: skip
        if self.x + width > 24:
            self._newline()
        self.panels.append(
            {
                "type": kind,
                "title": title,
                "description": description,
                "id": len(self.panels) + 1,
                "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(exprs)
                ],
            }
        )
        self.x += width

    def json(self) -> dict:
        return {
            "__inputs": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "Prometheus",
                    "type": "datasource",
                    "pluginId": "prometheus",
                    "pluginName": "Prometheus",
                }
            ],  # fmt: skip
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["gpushare"],
            "timezone": "utc",
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "refresh": "30s",
            "time": {"from": "now-6h", "to": "now"},
            "templating": {"list": self.variables},
            "panels": self.panels,
        }


def query_variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": False,
        "multi": False,
        "sort": 1,
    }


def fleet() -> Board:
    b = Board("gpushare-fleet", "gpushare · fleet", "GPUs, nodes, API, Celery, scheduling, metering and the gateway.")
    b.row("GPUs (dcgm-exporter names)")
    b.panel(
        "GPU utilisation",
        [("avg by (Hostname, gpu, modelName) (DCGM_FI_DEV_GPU_UTIL)", "{{Hostname}} gpu{{gpu}} {{modelName}}")],
        unit="percent",
    )
    b.panel(
        "GPU memory used",
        [("sum by (Hostname, gpu) (DCGM_FI_DEV_FB_USED)", "{{Hostname}} gpu{{gpu}}")],
        unit="decmbytes",
    )
    b.panel("Power", [("sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)", "{{Hostname}}")], unit="watt")
    b.panel(
        "Temperature", [("max by (Hostname, gpu) (DCGM_FI_DEV_GPU_TEMP)", "{{Hostname}} gpu{{gpu}}")], unit="celsius"
    )
    b.panel(
        "XID errors (1 h)",
        [
            (
                "sum by (Hostname, gpu, xid) (increase(gpushare_gpu_xid_errors_total[1h]))",
                "{{Hostname}} gpu{{gpu}} xid {{xid}}",
            )
        ],
    )
    b.panel(
        "Fleet GPU share held by jobs",
        [("sum(gpushare_job_sm_share) / count(DCGM_FI_DEV_GPU_UTIL)", "held")],
        unit="percentunit",
    )
    b.row("Node agents")
    b.panel("Broker connected", [("min by (Hostname) (gpushare_agent_broker_connected)", "{{Hostname}}")], kind="stat")
    b.panel(
        "Outbox depth (undelivered reports)", [("max by (Hostname) (gpushare_agent_outbox_messages)", "{{Hostname}}")]
    )
    b.panel(
        "Seconds since last GPU sample",
        [("time() - max by (Hostname) (gpushare_agent_last_sample_timestamp_seconds)", "{{Hostname}}")],
        unit="s",
    )
    b.panel("Jobs running", [("sum by (Hostname) (gpushare_agent_jobs_running)", "{{Hostname}}")])
    b.row("Web and API")
    b.panel(
        "Requests by view and status",
        [
            (
                "sum by (view, status) (rate(django_http_responses_total_by_status_view_method_total[5m]))",
                "{{view}} {{status}}",
            )
        ],
        unit="reqps",
    )
    b.panel(
        "5xx responses",
        [
            (
                'sum by (view) (rate(django_http_responses_total_by_status_view_method_total{status=~"5.."}[5m]))',
                "{{view}}",
            )
        ],
        unit="reqps",
    )
    b.panel(
        "Latency p95 by view",
        [
            (
                "histogram_quantile(0.95, sum by (le, view) (rate(django_http_requests_latency_seconds_by_view_method_bucket[5m])))",
                "{{view}}",
            )
        ],
        unit="s",
    )
    b.row("Celery and scheduling")
    b.panel(
        "Tasks by outcome",
        [("sum by (task, outcome) (rate(gpushare_celery_tasks_total[5m]))", "{{task}} {{outcome}}")],
        unit="ops",
    )
    b.panel(
        "Task failures",
        [('sum by (task) (rate(gpushare_celery_tasks_total{outcome="failed"}[5m]))', "{{task}}")],
        unit="ops",
    )
    b.panel("Queue depth", [("max by (queue) (gpushare_celery_queue_messages)", "{{queue}}")])
    b.panel(
        "Scheduling pass p95",
        [
            ("histogram_quantile(0.95, sum by (le) (rate(gpushare_scheduler_pass_seconds_bucket[5m])))", "p95"),
            ("histogram_quantile(0.5, sum by (le) (rate(gpushare_scheduler_pass_seconds_bucket[5m])))", "p50"),
        ],
        unit="s",
    )
    b.panel(
        "Placements per pass",
        [
            (
                "sum(rate(gpushare_scheduler_pass_placements_sum[5m])) / sum(rate(gpushare_scheduler_pass_placements_count[5m]))",
                "mean",
            ),
            ("sum(rate(gpushare_scheduler_placements_total[5m]))", "placements/s"),
            ("sum(rate(gpushare_scheduler_preemptions_total[5m]))", "preemptions/s"),
        ],
    )
    b.panel(
        "Task run time p95",
        [("histogram_quantile(0.95, sum by (le, task) (rate(gpushare_celery_task_seconds_bucket[5m])))", "{{task}}")],
        unit="s",
    )
    b.row("Metering and billing")
    b.panel(
        "Ingest lag p95 (window end -> stored)",
        [
            ("histogram_quantile(0.95, sum by (le) (rate(gpushare_usage_ingest_lag_seconds_bucket[5m])))", "p95"),
            ("histogram_quantile(0.99, sum by (le) (rate(gpushare_usage_ingest_lag_seconds_bucket[5m])))", "p99"),
        ],
        unit="s",
    )
    b.panel(
        "Metering windows", [("sum by (outcome) (rate(gpushare_usage_windows_total[5m]))", "{{outcome}}")], unit="ops"
    )
    b.panel(
        "Stripe webhooks refused (1 h)",
        [("sum by (reason) (increase(gpushare_stripe_webhook_refused_total[1h]))", "{{reason}}")],
        kind="stat",
    )
    b.row("Inference gateway")
    b.panel(
        "Requests by endpoint",
        [("sum by (tenant, endpoint) (rate(gpushare_gateway_requests_total[5m]))", "{{tenant}}/{{endpoint}}")],
        unit="reqps",
    )
    b.panel(
        "Errors (5xx) by endpoint",
        [
            (
                "sum by (tenant, endpoint, code) (rate(gpushare_gateway_errors_total[5m]))",
                "{{tenant}}/{{endpoint}} {{code}}",
            )
        ],
        unit="reqps",
    )
    b.panel(
        "Latency p95 by endpoint",
        [
            (
                "histogram_quantile(0.95, sum by (le, tenant, endpoint) (rate(gpushare_gateway_request_seconds_bucket[5m])))",
                "{{tenant}}/{{endpoint}}",
            )
        ],
        unit="s",
    )
    b.panel(
        "In flight and held for a replica",
        [
            ("sum by (tenant, endpoint) (gpushare_gateway_inflight_requests)", "{{tenant}}/{{endpoint}} in flight"),
            ("sum by (tenant, endpoint) (gpushare_gateway_queued_requests)", "{{tenant}}/{{endpoint}} held"),
        ],
    )
    b.panel(
        "Replicas ready", [("max by (tenant, endpoint) (gpushare_gateway_replicas_ready)", "{{tenant}}/{{endpoint}}")]
    )
    b.panel(
        "Replicas by state", [("max by (state) (sum by (state, instance) (gpushare_gateway_replicas))", "{{state}}")]
    )
    return b


def tenant() -> Board:
    t = '{tenant="$tenant"}'
    b = Board(
        "gpushare-tenant",
        "gpushare · tenant",
        "One tenant's jobs on GPUs and its inference endpoints.",
        [query_variable("tenant", "Tenant", "label_values(gpushare_job_sm_share, tenant)")],
    )
    b.row("Jobs on GPUs")
    b.panel("GPU share held", [(f"sum(gpushare_job_sm_share{t})", "GPUs")], kind="stat", width=6)
    b.panel("Jobs running", [(f"count(count by (job) (gpushare_job_sm_share{t}))", "jobs")], kind="stat", width=6)
    b.panel(
        "Energy (1 h)",
        [(f"sum(increase(gpushare_job_energy_joules_total{t}[1h])) / 3600000", "kWh")],
        kind="stat",
        width=6,
        unit="kwatth",
    )
    b.panel(
        "Power drawn now",
        [(f"sum(rate(gpushare_job_energy_joules_total{t}[2m]))", "W")],
        kind="stat",
        width=6,
        unit="watt",
    )
    b.panel(
        "SM utilisation by job",
        [(f"sum by (job, Hostname, gpu) (gpushare_job_sm_util_percent{t})", "job {{job}} {{Hostname}} gpu{{gpu}}")],
        unit="percent",
        width=12,
    )
    b.panel(
        "GPU memory by job", [(f"sum by (job) (gpushare_job_fb_used_mib{t})", "job {{job}}")], unit="mbytes", width=12
    )
    b.panel(
        "SM use against share held",
        [
            (
                f"sum by (job) (gpushare_job_sm_util_percent{t}) / 100 / sum by (job) (gpushare_job_sm_share{t})",
                "job {{job}}",
            )
        ],
        unit="percentunit",
        width=12,
    )
    b.panel(
        "Energy rate by job",
        [(f"sum by (job) (rate(gpushare_job_energy_joules_total{t}[5m]))", "job {{job}}")],
        unit="watt",
        width=12,
    )
    b.row("Inference endpoints")
    b.panel(
        "Requests",
        [(f"sum by (endpoint, code) (rate(gpushare_gateway_requests_total{t}[5m]))", "{{endpoint}} {{code}}")],
        unit="reqps",
    )
    b.panel(
        "Errors (5xx)",
        [(f"sum by (endpoint) (rate(gpushare_gateway_errors_total{t}[5m]))", "{{endpoint}}")],
        unit="reqps",
    )
    b.panel(
        "Latency p50 / p95",
        [
            (
                f"histogram_quantile(0.5, sum by (le, endpoint) (rate(gpushare_gateway_request_seconds_bucket{t}[5m])))",
                "{{endpoint}} p50",
            ),
            (
                f"histogram_quantile(0.95, sum by (le, endpoint) (rate(gpushare_gateway_request_seconds_bucket{t}[5m])))",
                "{{endpoint}} p95",
            ),
        ],
        unit="s",
    )
    b.panel("Replicas ready", [(f"max by (endpoint) (gpushare_gateway_replicas_ready{t})", "{{endpoint}}")])
    b.panel(
        "In flight / held",
        [
            (f"sum by (endpoint) (gpushare_gateway_inflight_requests{t})", "{{endpoint}} in flight"),
            (f"sum by (endpoint) (gpushare_gateway_queued_requests{t})", "{{endpoint}} held"),
        ],
    )
    return b


def render() -> dict[str, str]:
    return {
        f"{name}.json": json.dumps(board().json(), indent=2) + "\n"
        for name, board in (("fleet", fleet), ("tenant", tenant))
    }


if __name__ == "__main__":
    for filename, text in render().items():
        (HERE / filename).write_text(text)
        print(f"wrote {HERE / filename}")
