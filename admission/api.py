"""REST v1: ``GET quota/``: the tenant's limits, what it holds now, the headroom, the month and its money holds."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Count, Q, Sum
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import RoleAllows
from gpushare.api import ERROR_RESPONSES, TenantScopedMixin
from scheduler.models import MILLI_PER_GPU, Allocation

from .selectors import budget_status, endpoint_count, job_counts


def _gpus(milli: int | None):
    return None if milli is None else (milli // MILLI_PER_GPU if milli % MILLI_PER_GPU == 0 else milli / MILLI_PER_GPU)


def _room(limit, used):
    return None if limit is None else max(limit - used, 0)


class QuotaLimitsSerializer(serializers.Serializer):
    max_dedicated_gpus = serializers.IntegerField(allow_null=True)
    max_shared_gpus = serializers.FloatField(allow_null=True, help_text="Shared slice capacity, in GPUs.")
    max_gpus_per_job = serializers.IntegerField(allow_null=True)
    max_open_jobs = serializers.IntegerField(allow_null=True)
    max_queued_jobs = serializers.IntegerField(allow_null=True)
    max_endpoints = serializers.IntegerField(allow_null=True)
    max_replicas_per_endpoint = serializers.IntegerField(allow_null=True)
    max_log_bytes_per_job = serializers.IntegerField(allow_null=True, help_text="Older output is rotated off.")
    api_requests_per_minute = serializers.IntegerField(
        allow_null=True, help_text="For the whole tenant: all its tokens and sessions together."
    )
    max_disk_mb_per_job = serializers.IntegerField(allow_null=True, help_text="Scratch disk per job on the node.")
    gpu_hours_per_month = serializers.DecimalField(max_digits=14, decimal_places=3, allow_null=True)
    monthly_spend_limit = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True)


class QuotaHoldingSerializer(serializers.Serializer):
    dedicated_gpus = serializers.IntegerField(allow_null=True)
    shared_gpus = serializers.FloatField(allow_null=True)
    open_jobs = serializers.IntegerField(allow_null=True)
    queued_jobs = serializers.IntegerField(allow_null=True)
    endpoints = serializers.IntegerField(allow_null=True)


class QuotaHeadroomSerializer(QuotaHoldingSerializer):
    gpu_hours = serializers.DecimalField(max_digits=14, decimal_places=3, allow_null=True)
    spend = serializers.DecimalField(max_digits=14, decimal_places=2, allow_null=True)


class QuotaMonthSerializer(serializers.Serializer):
    gpu_hours_used = serializers.DecimalField(max_digits=14, decimal_places=3)
    spend = serializers.DecimalField(max_digits=14, decimal_places=2)
    gpu_hours_percent = serializers.DecimalField(max_digits=8, decimal_places=1, allow_null=True)
    spend_percent = serializers.DecimalField(max_digits=8, decimal_places=1, allow_null=True)
    alert = serializers.BooleanField(help_text="The month passed the budget alert threshold.")
    exhausted = serializers.BooleanField(help_text="The month's GPU-hours or spend is used up: submissions refused.")
    held = serializers.DecimalField(
        max_digits=14,
        decimal_places=2,
        help_text="Money reserved by unfinished jobs (max cost less what is metered) and live endpoints.",
    )
    budget_left = serializers.DecimalField(
        max_digits=14,
        decimal_places=2,
        allow_null=True,
        help_text="monthly_spend_limit - spend - held: the most a new job may cost (null: no spend limit).",
    )


@extend_schema_serializer(description="null in `limits` or `headroom` means no limit.")
class QuotaSerializer(serializers.Serializer):
    limits = QuotaLimitsSerializer()
    current = QuotaHoldingSerializer()
    headroom = QuotaHeadroomSerializer()
    month = QuotaMonthSerializer()


class QuotaView(TenantScopedMixin, APIView):
    permission_classes = [*TenantScopedMixin.permission_classes, RoleAllows]
    required_scopes = {"GET": "usage:read"}
    required_actions = {"GET": "quotas.read"}

    @extend_schema(
        summary="Quota, current use, headroom and the month's budget",
        responses={200: QuotaSerializer, **ERROR_RESPONSES},
    )
    def get(self, request):
        tenant = self.tenant
        status = budget_status(tenant)
        limits = status.limits
        held = Allocation.objects.filter(tenant=tenant, released_at__isnull=True).aggregate(
            dedicated=Count("pk", filter=Q(share_milli=MILLI_PER_GPU)),
            shared=Sum("share_milli", filter=Q(share_milli__lt=MILLI_PER_GPU)),
        )
        dedicated, shared_milli = held["dedicated"] or 0, held["shared"] or 0
        open_jobs, queued_jobs = job_counts(tenant)
        endpoints = endpoint_count(tenant)
        spend = status.usage.spend.quantize(Decimal("0.01"))
        body = {
            "limits": {
                "max_dedicated_gpus": limits.max_dedicated_gpus,
                "max_shared_gpus": _gpus(limits.max_shared_milli),
                "max_gpus_per_job": limits.max_gpus_per_job,
                "max_open_jobs": limits.max_open_jobs,
                "max_queued_jobs": limits.max_queued_jobs,
                "max_endpoints": limits.max_endpoints,
                "max_replicas_per_endpoint": limits.max_replicas_per_endpoint,
                "max_log_bytes_per_job": limits.max_log_bytes_per_job,
                "api_requests_per_minute": limits.api_requests_per_minute,
                "max_disk_mb_per_job": limits.max_disk_mb_per_job,
                "gpu_hours_per_month": limits.gpu_hours_per_month,
                "monthly_spend_limit": limits.monthly_spend_limit,
            },
            "current": {
                "dedicated_gpus": dedicated,
                "shared_gpus": _gpus(shared_milli),
                "open_jobs": open_jobs,
                "queued_jobs": queued_jobs,
                "endpoints": endpoints,
            },
            "headroom": {
                "dedicated_gpus": _room(limits.max_dedicated_gpus, dedicated),
                "shared_gpus": _gpus(_room(limits.max_shared_milli, shared_milli)),
                "open_jobs": _room(limits.max_open_jobs, open_jobs),
                "queued_jobs": _room(limits.max_queued_jobs, queued_jobs),
                "endpoints": _room(limits.max_endpoints, endpoints),
                "gpu_hours": _room(limits.gpu_hours_per_month, status.gpu_hours_used),
                "spend": _room(limits.monthly_spend_limit, spend),
            },
            "month": {
                "gpu_hours_used": status.gpu_hours_used,
                "spend": spend,
                "gpu_hours_percent": status.gpu_hours_percent,
                "spend_percent": status.spend_percent,
                "alert": status.alert,
                "exhausted": status.exhausted,
                "held": status.held,
                "budget_left": status.budget_left,
            },
        }
        return Response(QuotaSerializer(body).data)
