"""The operator console's admin pages.

This app is last in INSTALLED_APPS, so this module runs after the other apps'
admin registrations: for each model presented here, an earlier registration is
replaced. Every write goes through a service (which writes the audit row):
``save_model``/``save_related``/actions never call ``model.save()`` themselves.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils.html import format_html
from django_scopes import scopes_disabled

from accounts.models import AuditLog, Plan, Tenant, TenantQuota
from accounts.services import AccountsError, quota_set, tenant_reinstate, tenant_suspend
from accounts.tenancy import tenant_scope
from agents.models import Gpu, Node
from billing.models import Price
from gpushare.admin import ReadOnlyAdminMixin, UnscopedAdminMixin
from scheduler.models import JobKind, PriorityClass, SchedulerSettings
from scheduler.rules import SCHEDULER_KNOBS, RuleError, scheduler_settings_update

from . import replay, services
from .rules import ClassDraft, RuleSet, rules_problems

admin.site.site_header = "gpushare operator console"
admin.site.site_title = "gpushare console"
admin.site.index_title = "Operator console"


def _take_over(model, model_admin) -> None:
    if admin.site.is_registered(model):
        admin.site.unregister(model)
    admin.site.register(model, model_admin)


# --- priority classes ----------------------------------------------------------


class PriorityClassForm(forms.ModelForm):
    default_for_kind = forms.ChoiceField(choices=[("", "—"), *JobKind.choices], required=False)

    class Meta:
        model = PriorityClass
        fields = [
            "name",
            "rank",
            "preemptible",
            "may_preempt",
            "min_runtime_s",
            "grace_period_s",
            "price_multiplier",
            "default_for_kind",
        ]

    def draft(self) -> ClassDraft:
        data = self.cleaned_data
        return ClassDraft.from_form(data, name=data.get("name") or self.instance.name)

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        current = replay.ruleset_current()
        draft = self.draft()
        old_name = self.instance.name if self.instance.pk else None
        others = tuple(c for c in current.classes if c.name not in (old_name, draft.name))
        proposed = RuleSet(classes=(*others, draft), weights=current.weights, half_life_s=current.half_life_s)
        if old_name is None:  # a new class: nothing of that name is in force (the scheduler refuses a duplicate)
            current = RuleSet(classes=others, weights=current.weights, half_life_s=current.half_life_s)
        problems = rules_problems(proposed) or services.rules_dry_run(current=current, proposed=proposed)
        if problems:
            raise ValidationError(problems)
        return cleaned


class PriorityClassAdmin(admin.ModelAdmin):
    form = PriorityClassForm
    list_display = [
        "name",
        "rank",
        "preemptible",
        "preempts",
        "min_runtime_s",
        "grace_period_s",
        "price_multiplier",
        "default_for_kind",
    ]
    ordering = ["-rank"]
    filter_horizontal = ["may_preempt"]

    @admin.display(description="may preempt")
    def preempts(self, obj):
        return ", ".join(c.name for c in obj.may_preempt.all()) or "—"

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("may_preempt")

    def changelist_view(self, request, extra_context=None):
        messages.info(
            request,
            format_html(
                'To see a change\'s effect before saving it, use <a href="{}">Rules &amp; what-if</a>.',
                reverse("console:rules"),
            ),
        )
        return super().changelist_view(request, extra_context)

    def get_readonly_fields(self, request, obj=None):
        return ["name"] if obj else []  # jobs and invoice lines refer to a class by its name

    def has_delete_permission(self, request, obj=None):
        return False  # jobs and invoice lines refer to classes by name: retire a class by ranking it low

    def save_model(self, request, obj, form, change):
        pass  # written in save_related, with its may-preempt set, by one service

    def save_related(self, request, form, formsets, change):
        form.instance = services.priority_class_save(
            priority_class=form.instance if change else None, draft=form.draft(), actor=request.user
        )


_take_over(PriorityClass, PriorityClassAdmin)


# --- tenants, quotas, plans ---------------------------------------------------------


class TenantQuotaInline(admin.StackedInline):
    model = TenantQuota
    can_delete = False
    extra = 0
    max_num = 1
    fields = [
        "plan",
        "max_dedicated_gpus",
        "max_shared_milli",
        "max_gpus_per_job",
        "max_open_jobs",
        "max_queued_jobs",
        "max_endpoints",
        "max_replicas_per_endpoint",
        "max_log_bytes_per_job",
        "api_requests_per_minute",
        "max_disk_mb_per_job",
        "gpu_hours_per_month",
        "monthly_spend_limit",
        "budget_alert_percent",
        "on_budget_exhausted",
        "on_suspended",
    ]


class TenantAdmin(UnscopedAdminMixin, admin.ModelAdmin):
    list_display = ["slug", "name", "state", "plan_name", "created_at"]
    list_filter = ["state"]
    search_fields = ["slug", "name", "billing_email"]
    readonly_fields = ["slug", "state", "stripe_customer_id", "created_at"]
    fields = ["slug", "name", "state", "billing_email", "stripe_customer_id", "created_at"]
    inlines = [TenantQuotaInline]
    actions = ["suspend", "reinstate"]

    @admin.display(description="plan")
    def plan_name(self, obj):
        with tenant_scope(obj):
            quota = TenantQuota.objects.filter(tenant=obj).select_related("plan").first()
        return quota.plan.name if quota and quota.plan else "default"

    def has_add_permission(self, request):
        return False  # tenants sign up (accounts.services.tenant_create)

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        if form.changed_data:
            services.tenant_profile_update(
                tenant=obj, actor=request.user, changes={name: form.cleaned_data[name] for name in form.changed_data}
            )

    def save_formset(self, request, form, formset, change):
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []
        for quota_form in formset.forms:
            if not quota_form.has_changed():
                continue
            data = quota_form.cleaned_data
            limits = {name: data[name] for name in TenantQuotaInline.fields if name != "plan"}
            try:
                quota_set(tenant=form.instance, actor=request.user, plan=data.get("plan"), **limits)
            except AccountsError as exc:
                messages.error(request, f"Quota not saved: {exc}")

    def response_action(self, request, queryset):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            return super().response_action(request, queryset)

    @admin.action(description="Suspend the selected tenants (no new jobs; running jobs per their quota setting)")
    def suspend(self, request, queryset):
        for tenant in queryset:
            tenant_suspend(tenant=tenant, actor=request.user, reason=f"suspended by operator {request.user}")
        messages.success(request, f"Suspended {queryset.count()} tenant(s).")

    @admin.action(description="Reinstate the selected tenants")
    def reinstate(self, request, queryset):
        for tenant in queryset:
            tenant_reinstate(tenant=tenant, actor=request.user, reason=f"reinstated by operator {request.user}")
        messages.success(request, f"Reinstated {queryset.count()} tenant(s).")


_take_over(Tenant, TenantAdmin)


class PlanAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "max_dedicated_gpus",
        "max_shared_milli",
        "max_gpus_per_job",
        "max_open_jobs",
        "gpu_hours_per_month",
        "monthly_spend_limit",
        "on_budget_exhausted",
        "on_suspended",
    ]

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        services.plan_save(plan=obj, actor=request.user, changed=form.changed_data, created=not change)


_take_over(Plan, PlanAdmin)


# --- prices ----------------------------------------------------------------------


class PriceAdmin(admin.ModelAdmin):
    """Prices are effective-dated: add a new row from a date; past rows are never edited."""

    list_display = ["gpu_model", "mode", "per_gpu_hour", "currency", "effective_from"]
    list_filter = ["gpu_model", "mode"]
    ordering = ["gpu_model", "mode", "-effective_from"]

    def has_change_permission(self, request, obj=None):
        return obj is None  # the list is visible; a saved price is history

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        services.price_add(
            gpu_model=obj.gpu_model,
            mode=obj.mode,
            per_gpu_hour=obj.per_gpu_hour,
            currency=obj.currency,
            effective_from=obj.effective_from,
            actor=request.user,
        )


_take_over(Price, PriceAdmin)


# --- nodes -----------------------------------------------------------------------


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    can_delete = False
    fields = [
        "index",
        "uuid",
        "model",
        "memory_mb",
        "isolation",
        "health",
        "health_reason",
        "reservation",
        "last_metrics",
    ]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "state_reason", "address", "backend", "agent_version", "last_heartbeat_at"]
    list_filter = ["state"]
    readonly_fields = [
        "name",
        "state",
        "state_reason",
        "address",
        "agent_version",
        "driver_version",
        "cuda_version",
        "backend",
        "registered_at",
        "last_heartbeat_at",
    ]
    exclude = ["token_hash"]
    inlines = [GpuInline]
    actions = ["cordon", "drain", "uncordon"]

    def has_add_permission(self, request):
        return False  # nodes come from `manage.py` credentials and agent registration

    def has_delete_permission(self, request, obj=None):
        return False

    def _act(self, request, queryset, action):
        done = 0
        for node in queryset:
            try:
                getattr(services, f"node_{action}")(node=node, actor=request.user)
                done += 1
            except services.ConsoleError as exc:
                messages.error(request, str(exc))
        if done:
            messages.success(request, f"{action}: {done} node(s).")

    @admin.action(description="Cordon: no new jobs")
    def cordon(self, request, queryset):
        self._act(request, queryset, "cordon")

    @admin.action(description="Drain: no new jobs, cordoned once empty")
    def drain(self, request, queryset):
        self._act(request, queryset, "drain")

    @admin.action(description="Uncordon: back in the pool")
    def uncordon(self, request, queryset):
        self._act(request, queryset, "uncordon")


_take_over(Node, NodeAdmin)


# --- audit log ----------------------------------------------------------------------


class AuditLogAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["created_at", "actor", "tenant", "action", "target"]
    list_filter = ["action"]
    search_fields = ["action", "target", "actor__username", "tenant__slug"]
    readonly_fields = ["created_at", "actor", "tenant", "action", "target", "before", "after"]


_take_over(AuditLog, AuditLogAdmin)


# --- scheduler settings ----------------------------------------------------------------


class SchedulerSettingsAdmin(admin.ModelAdmin):
    """The scheduler's knobs, one row; saved through scheduler.rules.scheduler_settings_update (audited)."""

    fields = list(SCHEDULER_KNOBS)
    list_display = ["__str__", "fair_share_half_life_s", "default_max_runtime_s", "backfill", "defrag", "updated_at"]

    def has_add_permission(self, request):
        return not SchedulerSettings.objects.exists()

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        try:
            scheduler_settings_update(
                actor=request.user,
                fair_share_half_life_s=obj.fair_share_half_life_s,
                default_max_runtime_s=obj.default_max_runtime_s,
                backfill=obj.backfill,
                defrag=obj.defrag,
                defrag_min_interval_s=obj.defrag_min_interval_s,
                defrag_min_gain_s=obj.defrag_min_gain_s,
            )
        except RuleError as exc:
            messages.error(request, f"Not saved: {exc}")


_take_over(SchedulerSettings, SchedulerSettingsAdmin)
