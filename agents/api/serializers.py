"""REST v1 shapes for the operator's view of nodes."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from gpushare.serializers import StrictStrings

from ..models import Gpu, Node


class GpuHolderSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    tenant = serializers.CharField()
    share = serializers.FloatField(help_text="Fraction of the GPU held (1.0 = dedicated).")


class GpuSerializer(serializers.ModelSerializer):
    holders = serializers.SerializerMethodField()

    class Meta:
        model = Gpu
        fields = [
            "uuid",
            "index",
            "model",
            "memory_mb",
            "mig_mode",
            "isolation",
            "health",
            "health_reason",
            "reservation",
            "holders",
        ]
        read_only_fields = fields

    @extend_schema_field(GpuHolderSerializer(many=True))
    def get_holders(self, gpu: Gpu) -> list[dict]:
        # ``held_allocations`` is prefetched by the view (active allocations with their job's tenant).
        return [
            {"job": a.job_id, "tenant": a.tenant.slug, "share": a.share_milli / 1000}
            for a in getattr(gpu, "held_allocations", [])
        ]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    address = serializers.CharField(
        read_only=True,
        help_text="Where the gateway reaches the node's replicas, as its agent reported at registration "
        "(blank: none reported; the platform's GPUSHARE_NODE_ADDRESSES setting overrides it).",
    )

    class Meta:
        model = Node
        fields = [
            "name",
            "state",
            "state_reason",
            "address",
            "backend",
            "agent_version",
            "driver_version",
            "cuda_version",
            "registered_at",
            "last_heartbeat_at",
            "gpus",
        ]
        read_only_fields = fields


class NodeCommandSerializer(StrictStrings, serializers.Serializer):
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
