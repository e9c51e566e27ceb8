"""REST v1: jobs."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from gpushare.api import ApiError, TenantScopedMixin

from .. import services
from ..selectors import job_log_read, jobs_for_tenant
from .serializers import JobCreateSerializer, JobSerializer

MAX_LOG_READ = 1 << 20


class JobViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer
    filterset_fields = ["state", "kind"]
    required_scopes = {"GET": "jobs:read", "POST": "jobs:write"}

    def get_queryset(self):
        return jobs_for_tenant(tenant=self.tenant).prefetch_related("allocations__gpu")

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request):
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        spec = services.JobSpec(
            kind=v["kind"],
            gpu_milli=v["gpus"],
            command=v["command"],
            name=v["name"],
            env=v["env"],
            image=v["image"],
            gpu_model=v["gpu_model"],
            gpu_memory_mb=v.get("gpu_memory_mb"),
            priority=v["priority"],
            max_runtime_s=v.get("max_runtime_seconds"),
        )
        try:
            job = services.job_submit(tenant=self.tenant, user=request.user, spec=spec)
        except services.JobError as exc:
            status_code = {"forbidden": 403, "conflict": 409}.get(exc.code, 400)
            fields = {exc.field: [str(exc)]} if exc.field else {}
            raise ApiError(str(exc), code=exc.code, status_code=status_code, fields=fields) from exc
        job = self.get_queryset().get(pk=job.pk)
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        services.job_cancel(job=job, actor=request.user)
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[OpenApiParameter("offset", int, description="byte offset to read from")])
    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        job = get_object_or_404(self.get_queryset(), pk=pk)
        raw = request.query_params.get("offset", "0")
        if not raw.isdigit() or len(raw) > 15:
            raise ApiError("offset must be a non-negative integer byte offset", fields={"offset": ["invalid"]})
        data, next_offset = job_log_read(job, offset=int(raw), limit=MAX_LOG_READ)
        return Response(
            {
                "job": job.pk,
                "offset": int(raw),
                "next_offset": next_offset,
                "data": data.decode("utf-8", errors="replace"),
                "complete": job.finished_at is not None and not data,
            }
        )
