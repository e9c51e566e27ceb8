"""Jobs in the operator's console (Django admin): every tenant's, read-only; cancel goes through the service."""

from __future__ import annotations

from django.contrib import admin, messages

from gpushare.admin import ReadOnlyAdminMixin, UnscopedAdminMixin

from . import services
from .models import TERMINAL_STATES, Job, JobEvent


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = ["at", "from_state", "to_state", "detail"]
    readonly_fields = fields
    ordering = ["at", "pk"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(UnscopedAdminMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "tenant", "name", "kind", "gpu_milli", "state", "priority", "node", "submitted_at", "cost"]
    list_filter = ["state", "kind", "mode", "priority"]
    search_fields = ["=id", "name", "tenant__slug"]
    list_select_related = ["tenant", "priority", "node"]
    date_hierarchy = "submitted_at"
    ordering = ["-submitted_at"]
    inlines = [JobEventInline]
    actions = ["cancel"]
    exclude = ["env"]  # a tenant's environment may hold its secrets

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    @admin.action(description="Cancel the selected jobs (gracefully, as the tenant's cancel)")
    def cancel(self, request, queryset):
        done = 0
        for job in queryset.exclude(state__in=TERMINAL_STATES):
            try:
                services.job_cancel(job=job, actor=request.user, reason="cancelled by the operator")
                done += 1
            except services.JobError as exc:
                messages.error(request, f"job {job.pk}: {exc}")
        messages.success(request, f"Cancelling {done} job{'' if done == 1 else 's'}.")
