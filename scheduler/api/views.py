"""REST v1: jobs."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple

from django.db import connection
from django.http import Http404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.permissions import RoleAllows
from gpushare.api import ERROR_RESPONSES, ApiError, TenantScopedMixin
from gpushare.lean import LeanDispatchMixin
from gpushare.pagination import KeysetPagination
from gpushare.prepared import Prepared
from gpushare.renderers import JsonText

from .. import services
from ..array_services import job_array_submit_idempotent
from ..models import TERMINAL_STATES, Job
from ..selectors import job_log_end, job_log_poll, jobs_for_tenant
from .arrays import array_body, array_tasks_listable
from .filters import JobFilter
from .idempotency import MAX_KEY_LENGTH, job_submit_idempotent
from .page_selectors import job_page_rows
from .selectors import job_api_rows, job_api_rows_complete, job_metric_series, with_api_fields
from .serializers import (
    JobArraySerializer,
    JobCreateSerializer,
    JobLogSerializer,
    JobMetricsSerializer,
    JobSerializer,
    job_body,
)

MAX_LOG_READ = 1 << 20
# The agent ships a job's last log bytes just before it reports the exit, but
# the worker may store them in either order: a log is complete only once the
# job has been over for this long and nothing more arrived.
LOG_SETTLE = timedelta(seconds=3)

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    str,
    location=OpenApiParameter.HEADER,
    required=False,
    description=(
        "Any unique string (a UUID, or CI's run id + step). Within 24 h, the same key from the same tenant "
        "returns the job it created (200) instead of creating another; the same key with a different body is a 409."
    ),
)


class _Owned(NamedTuple):
    """What the object permissions read of a job (RoleAllows: ``owner_field``)."""

    submitted_by_id: int | None


def _job_id(raw: str) -> int:
    """A job id from the URL; anything else is a job that does not exist (404)."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise Http404
    return int(raw)


JOB_OR_ARRAY = PolymorphicProxySerializer(
    component_name="JobOrJobArray", serializers=[JobSerializer, JobArraySerializer], resource_type_field_name=None
)


def _job_page(shape, tenant_id, at=None, job_id=None):
    direction, after_key, size = shape
    rows = job_api_rows(jobs_for_tenant(tenant=tenant_id), computed=False)
    return KeysetPagination.ordered(rows, direction, (at, job_id) if after_key else None, size)


# The job list's page and a job's detail, the reads CI pollers make most, compiled once per shape.
JOB_PAGE = Prepared(_job_page, kinds={"at": datetime})
JOB_DETAIL = Prepared(
    lambda shape, tenant_id, job_id: job_api_rows(jobs_for_tenant(tenant=tenant_id), computed=True).filter(pk=job_id)
)


@extend_schema_view(
    list=extend_schema(summary="List the tenant's jobs", responses={200: JobSerializer(many=True), **ERROR_RESPONSES}),
    retrieve=extend_schema(summary="Get a job", responses={200: JobSerializer, **ERROR_RESPONSES}),
)
class JobViewSet(
    LeanDispatchMixin, TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = JobSerializer
    # A CI fleet's submits and polls: served without DRF's per-request wrapping when they are plain
    # bearer-token JSON calls (gpushare/lean.py), by the same handlers below.
    lean_actions = frozenset({"create", "list", "retrieve", "logs"})
    filterset_class = JobFilter
    pagination_class = KeysetPagination
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "jobs:read", "POST": "jobs:write"}
    required_actions = {"cancel": "jobs.cancel", "GET": "jobs.read", "POST": "jobs.submit"}
    owner_field = "submitted_by_id"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the view's shape
            return Job.objects.none()
        # One query for a job: queue position and GPUs are computed in it (no per-row query).
        return with_api_fields(jobs_for_tenant(tenant=self.tenant))

    def list(self, request, *args, **kwargs):
        # Without filters (what pollers ask), on PostgreSQL: the page's JSON, GPUs and queue places included,
        # written by the database in one statement planned once per connection and passed into the response
        # as is, or the same page this process kept while nothing on it changed (page_selectors). Elsewhere,
        # and with filters: the page as plain rows (no model instances) in one query, its GPUs in one more
        # and, when it shows queued jobs, their queue positions in a third; rendered straight into dicts.
        if request.query_params.keys().isdisjoint(JobFilter.base_filters):
            direction, key, size = self.paginator.window(request)
            if connection.vendor == "postgresql":
                rows = job_page_rows(tenant=self.tenant, direction=direction, key=key, size=size)
                page = self.paginator.paginate_rows(rows, request, direction, key, size)
                return self.get_paginated_response(JsonText(f"[{','.join(row['json'] for row in page)}]".encode()))
            values = {"tenant_id": self.tenant.pk}
            if key:
                values["at"], values["job_id"] = key
            rows = JOB_PAGE.rows((direction, key is not None, size), **values)
            page = self.paginator.paginate_rows(rows, request, direction, key, size)
        else:
            if "array" in request.query_params:
                array_tasks_listable(tenant=self.tenant, array_id=request.query_params["array"])
            jobs = job_api_rows(self.filter_queryset(jobs_for_tenant(tenant=self.tenant)), computed=False)
            page = self.paginate_queryset(jobs)
        return self.get_paginated_response([job_body(row) for row in job_api_rows_complete(page, tenant=self.tenant)])

    def retrieve(self, request, *args, **kwargs):
        """A job polled by its id: one indexed query of a plain row (queue position and GPUs in it), compiled
        once (gpushare.prepared)."""
        rows = JOB_DETAIL.rows(tenant_id=self.tenant.pk, job_id=_job_id(kwargs["pk"]))
        found = job_api_rows_complete(rows, tenant=self.tenant)
        if not found:
            raise Http404
        self.check_object_permissions(request, _Owned(found[0]["submitted_by_id"]))
        return Response(job_body(found[0]))

    @extend_schema(
        summary="Submit a job",
        request=JobCreateSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            201: OpenApiResponse(
                JOB_OR_ARRAY, description="Created: the job, or with `array` the job array (its tasks are jobs)."
            ),
            200: OpenApiResponse(JOB_OR_ARRAY, description="The job (or array) this Idempotency-Key created earlier."),
            **ERROR_RESPONSES,
        },
    )
    def create(self, request):
        key = request.headers.get("Idempotency-Key", "").strip()
        if len(key) > MAX_KEY_LENGTH or not key.isprintable() or not key.isascii():
            raise ApiError(
                f"Idempotency-Key must be printable ASCII of at most {MAX_KEY_LENGTH} characters",
                fields={"Idempotency-Key": ["invalid"]},
            )
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        spec = JobCreateSerializer.spec(data.validated_data)
        if "array" in data.validated_data:
            return self._array_create(request, spec, data.validated_data["array"], key)
        try:
            submitted = job_submit_idempotent(tenant=self.tenant, user=request.user, spec=spec, idempotency_key=key)
        except services.JobError as exc:
            raise ApiError.from_service(exc) from exc
        if not submitted.created:
            return Response(JobSerializer(self.get_queryset().get(pk=submitted.job.pk)).data)
        # The job as just committed (queued, never placed, nothing used): no need to read it back.
        context = {**self.get_serializer_context(), "gpu_uuids": {submitted.job.pk: []}}
        return Response(JobSerializer(submitted.job, context=context).data, status=status.HTTP_201_CREATED)

    def _array_create(self, request, spec, array, key: str) -> Response:
        try:
            submitted = job_array_submit_idempotent(
                tenant=self.tenant, user=request.user, spec=spec, array=array, idempotency_key=key
            )
        except services.JobError as exc:
            raise ApiError.from_service(exc) from exc
        return Response(
            array_body(submitted.array), status=status.HTTP_201_CREATED if submitted.created else status.HTTP_200_OK
        )

    @extend_schema(
        summary="Cancel a job",
        description="A queued job is cancelled at once; a placed or running one is stopped gracefully "
        "(signal, then the class's grace period). Cancelling a finished job changes nothing.",
        request=None,
        responses={202: JobSerializer, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        try:
            services.job_cancel(job=job, actor=request.user)
        except services.JobError as exc:
            raise ApiError.from_service(exc) from exc
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Read a job's log",
        description="Log text from byte `offset`, at most 1 MiB per call. Follow a job by asking again from "
        "`next_offset` until `complete` is true.",
        parameters=[OpenApiParameter("offset", OpenApiTypes.INT, description="byte offset to read from (default 0)")],
        responses={200: JobLogSerializer, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["get"], filterset_class=None)
    def logs(self, request, pk=None):
        raw = request.query_params.get("offset", "0")
        if not raw.isascii() or not raw.isdigit() or len(raw) > 15:
            raise ApiError("offset must be a non-negative integer byte offset", fields={"offset": ["invalid"]})
        found = job_log_poll(tenant=self.tenant, job_id=pk, offset=int(raw), limit=MAX_LOG_READ)
        if found is None:
            raise Http404
        job, data, next_offset = found
        settled = job.state in TERMINAL_STATES and job.finished_at and job.finished_at < timezone.now() - LOG_SETTLE
        body = {
            "job": job.pk,
            "offset": int(raw),
            "next_offset": next_offset,
            "data": data.decode("utf-8", errors="replace"),
            # Settled, and this read reached the end: one call can read a finished job's whole log
            # (the end is looked up only then, so polling a running job stays one query).
            "complete": bool(settled and (not data or next_offset >= job_log_end(job))),
        }
        return Response(body)

    @extend_schema(
        summary="A job's GPU metrics over time",
        description="One point per metering window (merged into at most 500 points for long jobs): SM "
        "utilisation %, average and peak GPU memory, mean power.",
        responses={200: JobMetricsSerializer, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["get"], filterset_class=None)
    def metrics(self, request, pk=None):
        job = self.get_object()
        return Response({"job": job.pk, **job_metric_series(job=job)})
