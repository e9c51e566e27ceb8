"""Inference endpoints: the list, and one endpoint's traffic, latency, replicas and cost."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404

from endpoints import metrics
from endpoints.models import Endpoint, Replica
from endpoints.selectors import with_totals

from ..tenancy import tenant_page
from .common import page

COST_DAYS = 30


def _endpoints(request):
    # Scoped to the portal's tenant: another tenant's endpoint is a 404 like a missing one.
    return Endpoint.objects.filter(tenant=request.portal.tenant, state=Endpoint.State.ACTIVE)


def invoke_url(endpoint: Endpoint) -> str:
    """Where clients send requests: the gateway's public address (GPUSHARE_GATEWAY_URL) and the endpoint's path."""
    return settings.GPUSHARE["GATEWAY_URL"].rstrip("/") + endpoint.gateway_path


@tenant_page
def endpoint_list(request):
    endpoints = list(with_totals(_endpoints(request)).select_related("tenant").prefetch_related("replicas"))
    traffic = metrics.recent_traffic(endpoints)
    rows = []
    for e in endpoints:
        replicas = [r for r in e.replicas.all() if r.state != Replica.State.STOPPED]
        rows.append(
            {
                "endpoint": e,
                "url": invoke_url(e),
                "live": len(replicas),
                "ready": sum(1 for r in replicas if r.state == Replica.State.READY),
                "traffic": traffic[e.pk],
                "cost": e.cost_total,
            }
        )
    return page(request, "portal/endpoints_list.html", {"rows": rows})


def _window(request):
    try:
        return metrics.window_named(request.GET.get("window"))
    except ValueError:
        return None


@tenant_page
def endpoint_detail(request, pk: int):
    endpoint = get_object_or_404(_endpoints(request).select_related("tenant"), pk=pk)
    window = _window(request)
    if window is None:
        return HttpResponseBadRequest(f"window must be one of {', '.join(metrics.WINDOWS)}")
    days = metrics.cost_by_day(endpoint, days=COST_DAYS)
    replicas = list(endpoint.replicas.select_related("job__node").order_by("-created_at", "-id")[:20])
    return page(
        request,
        "portal/endpoint_detail.html",
        {
            "endpoint": endpoint,
            "url": invoke_url(endpoint),
            "window": window,
            "windows": list(metrics.WINDOWS),
            "series": metrics.traffic_series(endpoint, window=window),
            "cost_days": {"labels": [d["date"].isoformat() for d in days], "cost": [str(d["amount"]) for d in days]},
            "cost_total": sum((d["amount"] for d in days), start=0),
            "replicas": replicas,
            "live": sum(1 for r in replicas if r.state != Replica.State.STOPPED),
            "events": list(endpoint.scaling_events.all()[:50]),
            "load": getattr(endpoint, "load", None),
        },
    )


@tenant_page
def endpoint_series(request, pk: int):
    """The charts' data, polled by the detail page to stay current."""
    endpoint = get_object_or_404(_endpoints(request), pk=pk)
    window = _window(request)
    if window is None:
        return JsonResponse({"error": f"window must be one of {', '.join(metrics.WINDOWS)}"}, status=400)
    return JsonResponse(metrics.traffic_series(endpoint, window=window))
