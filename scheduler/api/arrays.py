"""REST v1: job arrays (``POST /api/v1/jobs/`` with ``array`` creates one).

``GET /api/v1/arrays/`` and ``/arrays/{id}/``: the array with its task count per
state; ``POST /api/v1/arrays/{id}/cancel/`` cancels every unfinished task (queued
ones at once, running ones gracefully). The tasks themselves are jobs:
``GET /api/v1/jobs/?array={id}``, and each can be read or cancelled on its own. The submit stores the
array as one record; the task rows are made by the next scheduling pass or by the first list of them
(``array_tasks_listable``), whichever comes first.
"""

from __future__ import annotations

from django.db.models import Count
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from accounts.permissions import RoleAllows
from accounts.tenancy import tenant_scope
from gpushare.api import ERROR_RESPONSES, TenantScopedMixin
from gpushare.lean import LeanDispatchMixin

from ..array_services import array_tasks_make, job_array_cancel
from ..models import Job, JobArray, JobState
from .serializers import JobArraySerializer, job_array_body


def states_by_array(*, tenant, array_ids: list[int]) -> dict[int, dict[str, int]]:
    """Array id -> {state: task count} for ``tenant``'s arrays (a tenant or its id); one GROUP BY for a page,
    and one look for arrays whose tasks are not made yet (all of them queued)."""
    out: dict[int, dict[str, int]] = {pk: {} for pk in array_ids}
    with tenant_scope(tenant):
        rows = (
            Job.objects.filter(array_id__in=array_ids)
            .order_by()
            .values_list("array_id", "state")
            .annotate(n=Count("pk"))
        )
        for array_id, state, n in rows:
            out[array_id][state] = n
        waiting = JobArray.objects.filter(pk__in=array_ids, tasks_made=False).values_list("pk", "task_count")
        for array_id, count in waiting:
            out[array_id] = {JobState.QUEUED: count}
    return out


def array_body(array: JobArray) -> dict:
    if array.tasks_made:
        states = states_by_array(tenant=array.tenant_id, array_ids=[array.pk])
    else:  # just submitted (or read in the moment before the scheduler made its tasks): all queued
        states = {array.pk: {JobState.QUEUED: array.task_count}}
    return job_array_body(array, states.get(array.pk, {}))


def array_tasks_listable(*, tenant, array_id) -> None:
    """Before ``?array=ID`` lists an array's tasks: make them if the scheduler has not yet (moments after
    the submit), so a client that lists right after submitting sees every task. A bad id: the filter's 400."""
    try:
        pk = int(array_id)
    except (TypeError, ValueError):
        return
    with tenant_scope(tenant):
        array = JobArray.objects.filter(tenant=tenant, pk=pk, tasks_made=False).first()
    if array is not None:
        array_tasks_make(array=array)


@extend_schema_view(
    list=extend_schema(
        summary="List the tenant's job arrays", responses={200: JobArraySerializer(many=True), **ERROR_RESPONSES}
    ),
    retrieve=extend_schema(summary="Get a job array", responses={200: JobArraySerializer, **ERROR_RESPONSES}),
)
class JobArrayViewSet(
    LeanDispatchMixin, TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = JobArraySerializer
    lean_actions = frozenset({"list", "retrieve"})  # a sweep's polls (gpushare/lean.py)
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "jobs:read", "POST": "jobs:write"}
    required_actions = {"cancel": "jobs.cancel", "GET": "jobs.read", "POST": "jobs.submit"}
    owner_field = "submitted_by_id"
    filterset_class = None

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return JobArray.objects.none()
        return JobArray.objects.filter(tenant=self.tenant)

    def get_serializer_context(self):
        return {**super().get_serializer_context(), "states_by_array": getattr(self, "_states", {})}

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.get_queryset())
        self._states = states_by_array(tenant=self.tenant, array_ids=[a.pk for a in page])
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def retrieve(self, request, *args, **kwargs):
        return Response(array_body(self.get_object()))

    @extend_schema(
        summary="Cancel every unfinished task of an array",
        description="Queued tasks are cancelled at once; placed or running ones are stopped gracefully "
        "(signal, then the class's grace period). Finished tasks are left as they are.",
        request=None,
        responses={202: JobArraySerializer, **ERROR_RESPONSES},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        array = self.get_object()
        job_array_cancel(array=array, actor=request.user)
        return Response(array_body(array), status=status.HTTP_202_ACCEPTED)
