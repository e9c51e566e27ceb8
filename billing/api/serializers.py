"""REST v1 billing: input serializers validate shape; outputs are read-only."""

from __future__ import annotations

from rest_framework import serializers

from scheduler.api.serializers import GpusField
from scheduler.models import JobKind

from ..models import Invoice, InvoiceLine
from ..selectors import USAGE_GROUPS, line_figures


class UsageQuerySerializer(serializers.Serializer):
    start = serializers.DateTimeField(help_text="inclusive, ISO 8601 (UTC if no offset)")
    end = serializers.DateTimeField(help_text="exclusive, ISO 8601")
    group_by = serializers.ChoiceField(choices=USAGE_GROUPS, default="day")

    def validate(self, attrs):
        if attrs["end"] <= attrs["start"]:
            raise serializers.ValidationError({"end": ["end must be after start"]})
        if (attrs["end"] - attrs["start"]).days > 400:
            raise serializers.ValidationError({"end": ["a usage query spans at most 400 days"]})
        return attrs


class UsageRowSerializer(serializers.Serializer):
    day = serializers.CharField(required=False)
    job = serializers.IntegerField(required=False)
    gpu_model = serializers.CharField(required=False)
    held_gpu_seconds = serializers.DecimalField(max_digits=20, decimal_places=3)
    used_gpu_seconds = serializers.DecimalField(max_digits=20, decimal_places=3)
    cost = serializers.DecimalField(max_digits=30, decimal_places=10)  # exact: the API never rounds money


class EstimateQuerySerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=JobKind.choices)
    gpus = GpusField()
    max_runtime_seconds = serializers.IntegerField(min_value=1, max_value=30 * 24 * 3600)
    priority = serializers.CharField(required=False, allow_blank=True, default="")
    gpu_model = serializers.CharField(required=False, allow_blank=True, default="", max_length=64)


class EstimateSerializer(serializers.Serializer):
    gpu_model = serializers.CharField()
    mode = serializers.CharField()
    priority = serializers.CharField()
    gpus = serializers.SerializerMethodField()
    max_runtime_seconds = serializers.IntegerField(source="max_runtime_s")
    price_per_gpu_hour = serializers.DecimalField(source="per_gpu_hour", max_digits=12, decimal_places=4)
    multiplier = serializers.DecimalField(max_digits=6, decimal_places=3)
    cost_per_hour = serializers.DecimalField(source="per_hour", max_digits=14, decimal_places=2)
    max_cost = serializers.DecimalField(max_digits=14, decimal_places=2)

    def get_gpus(self, estimate) -> float:
        return estimate.gpu_milli / 1000


class HoldSerializer(serializers.Serializer):
    amount = serializers.DecimalField(
        max_digits=14, decimal_places=2, help_text="What submitting this job holds against the budget (its max cost)."
    )
    limit = serializers.DecimalField(
        max_digits=14, decimal_places=2, allow_null=True, help_text="monthly_spend_limit (null: none)."
    )
    held = serializers.DecimalField(max_digits=14, decimal_places=2, help_text="Held now by unfinished work.")
    left = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True, help_text="limit - spent - held.")
    fits = serializers.BooleanField(help_text="false: the submission would be refused (403 budget_exceeded).")


class SpendSerializer(serializers.Serializer):
    month = serializers.DateField()
    spent = serializers.DecimalField(max_digits=14, decimal_places=2)
    projected = serializers.DecimalField(max_digits=14, decimal_places=2)
    limit = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True)
    alert_percent = serializers.IntegerField(allow_null=True)
    alert = serializers.BooleanField()


class InvoiceLineSerializer(serializers.ModelSerializer):
    gpu_hours = serializers.SerializerMethodField()
    sm_util_hours = serializers.SerializerMethodField()
    memory_gb_seconds = serializers.SerializerMethodField()
    energy_kwh = serializers.SerializerMethodField()

    class Meta:
        model = InvoiceLine
        fields = [
            "id",
            "gpu_model",
            "mode",
            "priority_class",
            "rate_per_gpu_hour",
            "gpu_hours",
            "sm_util_hours",
            "memory_gb_seconds",
            "energy_kwh",
            "exact_amount",
            "amount",
        ]

    def get_gpu_hours(self, line) -> str:
        return str(line_figures(line).gpu_hours)

    def get_sm_util_hours(self, line) -> str:
        return str(line_figures(line).sm_util_hours)

    def get_memory_gb_seconds(self, line) -> str:
        return str(line_figures(line).memory_gb_seconds)

    def get_energy_kwh(self, line) -> str:
        return str(line_figures(line).energy_kwh)


class InvoiceSerializer(serializers.ModelSerializer):
    month = serializers.DateField(format="%Y-%m")

    class Meta:
        model = Invoice
        fields = ["id", "month", "state", "currency", "total", "created_at", "sent_at", "paid_at", "failure_message"]


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)

    class Meta(InvoiceSerializer.Meta):
        fields = [*InvoiceSerializer.Meta.fields, "lines"]
