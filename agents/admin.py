"""GPUs in the operator's console (Django admin): read-only; returning one to service goes through the service."""

from __future__ import annotations

from django.contrib import admin, messages

from gpushare.admin import ReadOnlyAdminMixin

from . import services
from .models import Gpu, LinkRefusal, QuarantinedWindow


@admin.register(Gpu)
class GpuAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["uuid", "node", "index", "model", "memory_mb", "isolation", "health", "reservation"]
    list_filter = ["health", "model", "isolation", "reservation", "node"]
    search_fields = ["uuid", "node__name", "model"]
    list_select_related = ["node"]
    ordering = ["node__name", "index"]
    actions = ["return_to_service"]

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    @admin.action(description="Return to service (health ok)")
    def return_to_service(self, request, queryset):
        for gpu in queryset:
            services.gpu_return_to_service(gpu=gpu, actor=request.user, note="from the admin")
        count = queryset.count()
        messages.success(request, f"{count} GPU{'' if count == 1 else 's'} back in service.")


@admin.register(LinkRefusal)
class LinkRefusalAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Node-link messages refused: commands an agent would not run, reports the platform would not believe."""

    list_display = ["at", "node", "direction", "task", "job_id", "reason"]
    list_filter = ["direction", "node"]
    search_fields = ["node__name", "task", "reason"]
    list_select_related = ["node"]

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff


@admin.register(QuarantinedWindow)
class QuarantinedWindowAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Usage windows ingest refused (never billed), with the reason."""

    list_display = ["received_at", "node", "job_id", "attempt", "seq", "reason"]
    list_filter = ["node"]
    search_fields = ["node__name", "reason", "job_id"]
    list_select_related = ["node"]

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff
