"""REST v1 billing: usage, spend, estimates and invoices (read-only, tenant-scoped)."""

from __future__ import annotations

import django_filters
from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import RoleAllows
from gpushare.api import ApiError, TenantScopedMixin
from scheduler.services import JobError, priority_for

from .. import selectors
from ..admission import hold_preview
from ..models import Invoice
from ..views import invoice_csv_response
from .serializers import (
    EstimateQuerySerializer,
    EstimateSerializer,
    HoldSerializer,
    InvoiceDetailSerializer,
    InvoiceSerializer,
    SpendSerializer,
    UsageQuerySerializer,
    UsageRowSerializer,
)


class UsageView(TenantScopedMixin, APIView):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "usage:read"}
    required_actions = {"GET": "usage.read"}

    @extend_schema(parameters=[UsageQuerySerializer], responses=UsageRowSerializer(many=True))
    def get(self, request):
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        v = query.validated_data
        rows = selectors.usage_summary(tenant=self.tenant, start=v["start"], end=v["end"], group_by=v["group_by"])
        return Response({"group_by": v["group_by"], "results": UsageRowSerializer(rows, many=True).data})


class SpendView(TenantScopedMixin, APIView):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "usage:read"}
    required_actions = {"GET": "usage.read"}

    @extend_schema(responses=SpendSerializer)
    def get(self, request):
        summary = selectors.spend_summary(tenant=self.tenant, at=timezone.now())
        return Response(SpendSerializer(summary).data)


class EstimateView(TenantScopedMixin, APIView):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "usage:read"}
    required_actions = {"GET": "usage.read"}

    @extend_schema(
        parameters=[EstimateQuerySerializer],
        responses=inline_serializer(
            "EstimateResponse", {"results": EstimateSerializer(many=True), "hold": HoldSerializer(allow_null=True)}
        ),
    )
    def get(self, request):
        query = EstimateQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        v = query.validated_data
        try:
            priority = priority_for(kind=v["kind"], name=v["priority"])
        except JobError as exc:
            raise ApiError(str(exc), fields={"priority": [str(exc)]}) from exc
        if v["kind"] == "training" and v["gpus"] % 1000:
            raise ApiError("training jobs take whole GPUs: gpus must be an integer", fields={"gpus": ["whole GPUs"]})
        try:
            estimates = selectors.job_estimate(
                gpu_milli=v["gpus"],
                max_runtime_s=v["max_runtime_seconds"],
                priority=priority,
                gpu_model=v["gpu_model"],
                at=timezone.now(),
            )
        except selectors.EstimateError as exc:
            raise ApiError(str(exc), fields={exc.field: [str(exc)]}) from exc
        preview = hold_preview(
            tenant=self.tenant,
            mode=estimates[0].mode,
            gpu_milli=v["gpus"],
            gpu_model=v["gpu_model"],
            max_runtime_s=v["max_runtime_seconds"],
            multiplier=priority.price_multiplier,
        )
        return Response(
            {"results": EstimateSerializer(estimates, many=True).data, "hold": HoldSerializer(preview).data}
        )


class InvoiceFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=Invoice.State.choices)

    class Meta:
        model = Invoice
        fields: list[str] = []


class InvoiceViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "billing:read"}
    required_actions = {"GET": "billing.read"}
    filterset_class = InvoiceFilter

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the view's shape
            return Invoice.objects.none()
        qs = selectors.invoices_for_tenant(tenant=self.tenant)
        return qs.prefetch_related("lines") if self.action != "list" else qs

    def get_serializer_class(self):
        return InvoiceSerializer if self.action == "list" else InvoiceDetailSerializer

    @extend_schema(description="Per-job detail of the invoice as CSV.", responses={(200, "text/csv"): str})
    @action(detail=True, methods=["get"])
    def csv(self, request, pk=None):
        return invoice_csv_response(self.get_object())
