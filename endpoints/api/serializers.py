"""REST v1 shapes for endpoints."""

from __future__ import annotations

from rest_framework import serializers

from gpushare.serializers import StrictStrings, money_exact
from scheduler.api.serializers import EnvField, GpusField

from ..models import Endpoint, Replica, ScalingEvent

MAX_REPLICAS = 64


class EndpointWriteSerializer(StrictStrings, serializers.Serializer):
    name = serializers.SlugField(max_length=63)
    command = serializers.ListField(child=serializers.CharField(max_length=8192), min_length=1, max_length=1000)
    image = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
    env = EnvField(required=False, default=dict)
    gpus = GpusField()
    gpu_model = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    priority = serializers.CharField(max_length=50, required=False, allow_blank=True, default="")
    min_replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=0)
    max_replicas = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, default=1)
    concurrency_target = serializers.IntegerField(min_value=1, max_value=10_000, default=4)
    idle_timeout_seconds = serializers.IntegerField(min_value=1, max_value=7 * 24 * 3600, default=60)
    health_path = serializers.CharField(max_length=200, default="/health")


class EndpointUpdateSerializer(EndpointWriteSerializer):
    name = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, partial=True, **kwargs)


class ScaleSerializer(serializers.Serializer):
    min_replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS)
    max_replicas = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS)


class ReplicaSerializer(serializers.ModelSerializer):
    job = serializers.IntegerField(source="job_id")
    job_state = serializers.CharField(source="job.state")
    node = serializers.CharField(source="job.node.name", default=None)

    class Meta:
        model = Replica
        fields = ["id", "job", "job_state", "node", "version", "port", "state", "created_at", "ready_at", "stopped_at"]


class ScalingEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ScalingEvent
        fields = ["at", "from_replicas", "to_replicas", "reason"]


class EndpointSerializer(serializers.ModelSerializer):
    gpus = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()
    idle_timeout_seconds = serializers.IntegerField(source="idle_timeout_s")
    replicas = serializers.SerializerMethodField()
    cost = serializers.SerializerMethodField()
    replica_seconds = serializers.SerializerMethodField()

    class Meta:
        model = Endpoint
        fields = [
            "id",
            "name",
            "url",
            "state",
            "version",
            "command",
            "image",
            "gpus",
            "gpu_model",
            "priority",
            "min_replicas",
            "max_replicas",
            "concurrency_target",
            "idle_timeout_seconds",
            "health_path",
            "replicas",
            "cost",
            "replica_seconds",
            "created_at",
            "updated_at",
        ]

    def get_gpus(self, endpoint) -> float:
        whole, rest = divmod(endpoint.gpu_milli, 1000)
        return whole if rest == 0 else endpoint.gpu_milli / 1000

    def get_url(self, endpoint) -> str:
        return endpoint.gateway_path

    def get_replicas(self, endpoint) -> list[dict]:
        live = [r for r in endpoint.replicas.all() if r.state != Replica.State.STOPPED]
        return ReplicaSerializer(live, many=True).data

    def get_cost(self, endpoint) -> str:
        return money_exact(endpoint.cost_total)  # annotated: selectors.with_totals; exact, as all API money

    def get_replica_seconds(self, endpoint) -> float:
        # gpu_ms is held GPU time × the slice fraction: divide it back out.
        return round(endpoint.gpu_ms_total / endpoint.gpu_milli, 3) if endpoint.gpu_milli else 0.0
