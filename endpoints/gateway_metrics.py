"""The gateway's Prometheus series, health and readiness (the ``Gateway``'s ``metrics`` and ``ops``).

| series | type | labels | what |
|---|---|---|---|
| ``gpushare_gateway_requests_total`` | counter | tenant, endpoint, code | requests answered |
| ``gpushare_gateway_errors_total`` | counter | tenant, endpoint, code | of those, answered 5xx |
| ``gpushare_gateway_request_seconds`` | histogram | tenant, endpoint | time to the last byte, cold starts included |
| ``gpushare_gateway_inflight_requests`` | gauge | tenant, endpoint | requests being answered now |
| ``gpushare_gateway_queued_requests`` | gauge | tenant, endpoint | requests held for a replica to start |
| ``gpushare_gateway_replicas`` | gauge | tenant, endpoint, state | replicas in the routing table, by state |
| ``gpushare_gateway_replicas_ready`` | gauge | tenant, endpoint | replicas the gateway sends traffic to |

Only endpoints in the routing table get their own labels; a request for a
name that does not exist is counted under ``tenant=""``, ``endpoint=""``, so
nobody can mint series by requesting random paths.

``/healthz``: the process answers. ``/readyz``: the database answers (the
routing table and tokens come from it). ``/metrics``: needs
``GPUSHARE_METRICS_TOKEN`` as a Bearer token (without one, only a DEBUG
server's loopback clients may read it), as on the web.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, gateway):
        self.gateway = gateway
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        labels = ["tenant", "endpoint"]
        self.requests = Counter(
            "gpushare_gateway_requests", "Requests answered by the gateway.", [*labels, "code"], registry=self.registry
        )
        self.errors = Counter(
            "gpushare_gateway_errors", "Requests the gateway answered 5xx.", [*labels, "code"], registry=self.registry
        )
        self.latency = Histogram(
            "gpushare_gateway_request_seconds",
            "Time from the request to its last byte, through the gateway.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "gpushare_gateway_inflight_requests", "Requests being answered now.", labels, registry=self.registry
        )
        self.registry.register(_TableCollector(gateway))
        # The labelled children, looked up once: ``labels()`` costs more than the increment itself.
        self.series: dict[tuple[str, str], tuple] = {}
        self.answered: dict[tuple[str, str, int], tuple] = {}

    def series_of(self, labels: tuple[str, str]) -> tuple:
        """(in flight gauge, latency histogram) of an endpoint's labels."""
        if (found := self.series.get(labels)) is None:
            found = self.series[labels] = (self.inflight.labels(*labels), self.latency.labels(*labels))
        return found

    def count(self, labels: tuple[str, str], code: int) -> None:
        if (found := self.answered.get((*labels, code))) is None:
            errors = self.errors.labels(*labels, str(code)) if code >= 500 else None
            found = self.answered[(*labels, code)] = (self.requests.labels(*labels, str(code)), errors)
        found[0].inc()
        if found[1] is not None:
            found[1].inc()

    def labels_for(self, tenant: str, name: str) -> tuple[str, str]:
        key = (tenant, name)
        return key if key in self.gateway.table else ("", "")


class _TableCollector:
    """Replicas and held requests, read from the gateway's routing table at scrape time."""

    def __init__(self, gateway):
        self.gateway = gateway

    def collect(self):
        replicas = GaugeMetricFamily(
            "gpushare_gateway_replicas",
            "Replicas in the routing table, by state.",
            labels=["tenant", "endpoint", "state"],
        )
        ready = GaugeMetricFamily(
            "gpushare_gateway_replicas_ready", "Replicas the gateway sends traffic to.", labels=["tenant", "endpoint"]
        )
        queued = GaugeMetricFamily(
            "gpushare_gateway_queued_requests", "Requests held for a replica to start.", labels=["tenant", "endpoint"]
        )
        for (tenant, name), route in list(self.gateway.table.items()):
            states: dict[str, int] = {}
            for replica in route.replicas:
                states[replica.state] = states.get(replica.state, 0) + 1
            for state, count in sorted(states.items()):
                replicas.add_metric([tenant, name, state], count)
            ready.add_metric([tenant, name], states.get("ready", 0))
            traffic = self.gateway.traffic.get(route.endpoint_id)
            queued.add_metric([tenant, name], traffic.queued if traffic else 0)
        yield replicas
        yield ready
        yield queued


def ops_views(gateway) -> dict:
    """``/healthz``, ``/readyz`` and ``/metrics`` on the gateway's own port, by path."""

    def send_json(reply, status: int, body: dict) -> None:
        reply.send(status, [(b"Content-Type", b"application/json; charset=utf-8")], json.dumps(body).encode())

    async def healthz(request, reply):
        send_json(reply, 200, {"ok": True, "endpoints": len(gateway.table)})

    async def readyz(request, reply):
        from asgiref.sync import sync_to_async

        from gpushare.observability.health import checks_run

        results = await sync_to_async(checks_run, thread_sensitive=False)(["database"])
        ready = all(v == "ok" for v in results.values())
        send_json(reply, 200 if ready else 503, {"ready": ready, "checks": results})

    async def metrics_view(request, reply):
        from gpushare.observability.health import metrics_refusal

        refusal = metrics_refusal(
            authorization=(request.header(b"authorization") or b"").decode("latin-1"),
            remote_addr=(request.peer or ("",))[0],
        )
        if refusal is not None:
            code = "unauthenticated" if refusal[0] == 401 else "forbidden"
            send_json(reply, refusal[0], {"error": {"code": code, "message": refusal[1], "fields": {}}})
            return
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, gateway.metrics.registry)
        reply.send(200, [(b"Content-Type", b"text/plain; version=0.0.4; charset=utf-8")], body)

    return {b"/healthz": healthz, b"/readyz": readyz, b"/metrics": metrics_view}
