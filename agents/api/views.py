"""REST v1: the fleet, for operators (staff users, by session or by a staff user's token)."""

from __future__ import annotations

from django.db.models import Prefetch
from django_scopes import scopes_disabled
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, permissions, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from gpushare.api import ERROR_RESPONSES, ApiError
from scheduler.models import Allocation

from .. import services
from ..models import Gpu, Node
from .serializers import NodeCommandSerializer, NodeSerializer


class IsOperator(permissions.BasePermission):
    message = "Only platform operators (staff users) may see or change nodes."

    def has_permission(self, request, view) -> bool:
        user = request.user
        return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff)


def _command_schema(summary: str, description: str):
    return extend_schema(
        summary=summary,
        description=description,
        request=NodeCommandSerializer,
        responses={200: NodeSerializer, **ERROR_RESPONSES},
    )


@extend_schema_view(
    list=extend_schema(summary="List nodes (operators)", responses={200: NodeSerializer(many=True), **ERROR_RESPONSES}),
    retrieve=extend_schema(summary="Get a node (operators)", responses={200: NodeSerializer, **ERROR_RESPONSES}),
)
class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = NodeSerializer
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    filterset_fields = ["state"]
    queryset = Node.objects.none()

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the view's shape
            return Node.objects.none()
        held = Allocation.objects.filter(released_at__isnull=True).select_related("tenant").order_by("job_id")
        gpus = Gpu.objects.order_by("index").prefetch_related(
            Prefetch("allocations", queryset=held, to_attr="held_allocations")
        )
        return Node.objects.order_by("name").prefetch_related(Prefetch("gpus", queryset=gpus))

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        # Operators see every tenant's allocations: this view is platform-wide on purpose.
        self._unscoped = scopes_disabled()
        self._unscoped.__enter__()

    def finalize_response(self, request, response, *args, **kwargs):
        unscoped = getattr(self, "_unscoped", None)
        if unscoped is not None:
            unscoped.__exit__(None, None, None)
            self._unscoped = None
        return super().finalize_response(request, response, *args, **kwargs)

    def _command(self, request, service, extra):
        node = self.get_object()
        data = NodeCommandSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            service(node=node, actor=request.user, **extra(data.validated_data))
        except services.NodeStateError as exc:
            raise ApiError(str(exc), code="conflict", status_code=409) from exc
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data)

    @_command_schema("Cordon a node", "No new jobs are placed on it; what runs there keeps running.")
    @action(detail=True, methods=["post"], filterset_fields=[])
    def cordon(self, request, name=None):
        return self._command(request, services.node_cordon, extra=lambda v: {"reason": v["reason"]})

    @_command_schema("Drain a node", "No new jobs; the node becomes cordoned once its last job ends.")
    @action(detail=True, methods=["post"], filterset_fields=[])
    def drain(self, request, name=None):
        return self._command(request, services.node_drain, extra=lambda v: {"reason": v["reason"]})

    @_command_schema("Uncordon a node", "The node is back in the pool; a scheduling pass follows.")
    @action(detail=True, methods=["post"], filterset_fields=[])
    def uncordon(self, request, name=None):
        return self._command(request, services.node_uncordon, extra=lambda v: {})
