"""REST v1: inference endpoints."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.permissions import RoleAllows
from gpushare.api import ERROR_RESPONSES, ApiError, TenantScopedMixin
from scheduler.services import JobError

from .. import metrics, services
from ..models import Endpoint, EndpointLoad, Replica
from ..selectors import with_totals
from .serializers import (
    EndpointSerializer,
    EndpointUpdateSerializer,
    EndpointWriteSerializer,
    ScaleSerializer,
    ScalingEventSerializer,
)


def _values(data: dict) -> dict:
    """API field names -> model/service names."""
    out = dict(data)
    if "gpus" in out:
        out["gpu_milli"] = out.pop("gpus")
    if "idle_timeout_seconds" in out:
        out["idle_timeout_s"] = out.pop("idle_timeout_seconds")
    return out


@extend_schema_view(
    list=extend_schema(
        summary="List the tenant's endpoints",
        parameters=[
            OpenApiParameter(
                "name", str, required=False, description="only the endpoint with exactly this name (what the CLI uses)"
            )
        ],
        responses={200: EndpointSerializer(many=True), **ERROR_RESPONSES},
    ),
    retrieve=extend_schema(
        summary="Get an endpoint with its replicas", responses={200: EndpointSerializer, **ERROR_RESPONSES}
    ),
)
class EndpointViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = EndpointSerializer
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "jobs:read", "*": "jobs:write"}
    required_actions = {"GET": "jobs.read", "*": "jobs.submit"}

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Endpoint.objects.none()
        endpoints = Endpoint.objects.filter(tenant=self.tenant, state=Endpoint.State.ACTIVE)
        if self.action == "list" and "name" in self.request.query_params:
            endpoints = endpoints.filter(name=self._name_param())
        # Explicit order: an aggregated query drops Meta.ordering, and pages must not shuffle.
        return (
            with_totals(endpoints)
            .order_by("name", "pk")
            .select_related("tenant")
            .prefetch_related("replicas__job__node")
        )

    def _name_param(self) -> str:
        """``?name=``: an endpoint name is a slug, so anything else is a typo worth a 400, not an empty list."""
        name = self.request.query_params["name"]
        try:
            validate_slug(name)
        except ValidationError as exc:
            raise ApiError(
                "name must be an endpoint name (letters, digits, - and _)", fields={"name": ["invalid"]}
            ) from exc
        return name

    @extend_schema(
        summary="Deploy an endpoint",
        request=EndpointWriteSerializer,
        responses={201: EndpointSerializer, **ERROR_RESPONSES},
    )
    def create(self, request):
        data = EndpointWriteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        spec = services.EndpointSpec(**_values(data.validated_data))
        try:
            endpoint = services.endpoint_create(tenant=self.tenant, user=request.user, spec=spec)
        except (services.EndpointError, JobError) as exc:
            raise ApiError.from_service(exc) from exc
        return Response(
            EndpointSerializer(self.get_queryset().get(pk=endpoint.pk)).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(
        summary="Change an endpoint (a new command, image, slice or env rolls out a new version)",
        request=EndpointUpdateSerializer,
        responses={200: EndpointSerializer, **ERROR_RESPONSES},
    )
    def partial_update(self, request, pk=None):
        endpoint = self.get_object()
        data = EndpointUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            services.endpoint_update(endpoint=endpoint, user=request.user, changes=_values(data.validated_data))
        except (services.EndpointError, JobError) as exc:
            raise ApiError.from_service(exc) from exc
        return Response(EndpointSerializer(self.get_queryset().get(pk=endpoint.pk)).data)

    @extend_schema(
        summary="Delete an endpoint (its replicas drain and stop)",
        request=None,
        responses={204: None, **ERROR_RESPONSES},
    )
    def destroy(self, request, pk=None):
        services.endpoint_delete(endpoint=self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="Set an endpoint's replica bounds",
        request=ScaleSerializer,
        responses={200: EndpointSerializer, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["post"])
    def scale(self, request, pk=None):
        endpoint = self.get_object()
        data = ScaleSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            services.endpoint_update(endpoint=endpoint, user=request.user, changes=dict(data.validated_data))
        except services.EndpointError as exc:
            raise ApiError.from_service(exc) from exc
        return Response(EndpointSerializer(self.get_queryset().get(pk=endpoint.pk)).data)

    @extend_schema(
        summary="Traffic, latency, replicas and cost of an endpoint over a window",
        parameters=[
            OpenApiParameter(
                "window",
                str,
                enum=list(metrics.WINDOWS),
                description="history shown in `series` (default 1h; one point per minute, 5 min, 15 min, 1 h)",
            ),
            OpenApiParameter("days", int, description="days of `cost_by_day` (1-90, default 30)"),
        ],
        responses={200: dict, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request, pk=None):
        endpoint = self.get_object()
        try:
            window = metrics.window_named(request.query_params.get("window"))
        except ValueError as exc:
            raise ApiError(str(exc), fields={"window": [str(exc)]}) from exc
        raw_days = request.query_params.get("days", "30")
        if not raw_days.isdigit() or not 1 <= int(raw_days) <= 90:
            message = "days must be a whole number from 1 to 90"
            raise ApiError(message, fields={"days": [message]})
        load = EndpointLoad.objects.filter(endpoint=endpoint).first()
        events = endpoint.scaling_events.all()[:100]
        live = endpoint.replicas.exclude(state=Replica.State.STOPPED).count()
        return Response(
            {
                "replicas": live,
                "inflight": load.inflight if load else 0,
                "queued": load.queued if load else 0,
                "requests_total": load.requests_total if load else 0,
                "errors_total": load.errors_total if load else 0,
                "latency_ms": load.latency_ms if load else {},
                "series": metrics.traffic_series(endpoint, window=window),
                "cost_by_day": [
                    {"date": row["date"].isoformat(), "gpu_ms": row["gpu_ms"], "cost": str(row["amount"])}
                    for row in metrics.cost_by_day(endpoint, days=int(raw_days))
                ],
                "scaling_events": ScalingEventSerializer(events, many=True).data,
            }
        )
