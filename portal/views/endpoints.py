"""Inference endpoints: the list, and one endpoint's traffic, latency, replicas and cost."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.http import HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from endpoints import metrics
from endpoints import services as endpoint_services
from endpoints.models import Endpoint, Replica
from endpoints.selectors import with_totals

from ..endpoint_forms import EndpointEditForm, EndpointForm, ScaleForm
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


# --- create, change, scale, delete (what the API and CLI do, from the browser) -------------------


def _service_values(validated: dict) -> dict:
    out = dict(validated)
    if "gpus" in out:
        out["gpu_milli"] = out.pop("gpus")
    if "idle_timeout_seconds" in out:
        out["idle_timeout_s"] = out.pop("idle_timeout_seconds")
    return out


def _service_error(form, exc) -> None:
    field = getattr(exc, "field", None)
    form.add_error(field if field in form.fields else None, str(exc))


@tenant_page(action="jobs.submit")
def endpoint_create(request):
    form = EndpointForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            spec = endpoint_services.EndpointSpec(**_service_values(form.validated))
            endpoint = endpoint_services.endpoint_create(tenant=request.portal.tenant, user=request.user, spec=spec)
        except (endpoint_services.EndpointError, endpoint_services.scheduler_services.JobError) as exc:
            _service_error(form, exc)
        else:
            messages.success(request, f"Endpoint {endpoint.name} created.")
            return redirect("portal:endpoint", pk=endpoint.pk)
    status = 400 if request.method == "POST" else 200
    return page(request, "portal/endpoint_form.html", {"form": form, "endpoint": None}, status=status)


@tenant_page(action="jobs.submit")
def endpoint_edit(request, pk: int):
    endpoint = get_object_or_404(_endpoints(request), pk=pk)
    if request.method == "POST":
        form = EndpointEditForm(request.POST)
        if form.is_valid():
            try:
                changed = endpoint_services.endpoint_update(
                    endpoint=endpoint, user=request.user, changes=_service_values(form.validated)
                )
            except (endpoint_services.EndpointError, endpoint_services.scheduler_services.JobError) as exc:
                _service_error(form, exc)
            else:
                rolled = changed.version != endpoint.version
                note = f" Rolling out version {changed.version}." if rolled else ""
                messages.success(request, f"Endpoint {endpoint.name} updated.{note}")
                return redirect("portal:endpoint", pk=endpoint.pk)
        return page(request, "portal/endpoint_form.html", {"form": form, "endpoint": endpoint}, status=400)
    form = EndpointEditForm(initial=EndpointEditForm.initial_from(endpoint))
    return page(request, "portal/endpoint_form.html", {"form": form, "endpoint": endpoint})


@tenant_page(action="jobs.submit")
@require_POST
def endpoint_scale(request, pk: int):
    endpoint = get_object_or_404(_endpoints(request), pk=pk)
    form = ScaleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Min and max replicas are whole numbers (min 0 to 64, max 1 to 64).")
        return redirect("portal:endpoint", pk=endpoint.pk)
    try:
        endpoint_services.endpoint_update(endpoint=endpoint, user=request.user, changes=dict(form.cleaned_data))
    except endpoint_services.EndpointError as exc:
        messages.error(request, str(exc))
    else:
        low, high = form.cleaned_data["min_replicas"], form.cleaned_data["max_replicas"]
        messages.success(request, f"Endpoint {endpoint.name} now scales between {low} and {high} replicas.")
    return redirect("portal:endpoint", pk=endpoint.pk)


@tenant_page(action="jobs.submit")
@require_POST
def endpoint_delete(request, pk: int):
    endpoint = get_object_or_404(_endpoints(request), pk=pk)
    endpoint_services.endpoint_delete(endpoint=endpoint, user=request.user)
    messages.success(request, f"Endpoint {endpoint.name} deleted; its replicas drain and stop.")
    return redirect("portal:endpoints")
