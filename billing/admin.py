"""The operator's console for billing: invoices, discounts, the collection policy, Stripe events.

Prices are edited in console/admin.py (effective-dated rows). Tenant-owned rows
are read with django-scopes disabled; every change goes through a service.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html
from django_scopes import scopes_disabled

from accounts.admin import UnscopedReadOnlyAdmin

from .gateway import GatewayError
from .models import BillingPolicy, Invoice, InvoiceLine, StripeEvent, TenantDiscount, UsageWindow
from .services.invoices import InvoiceError, invoice_void
from .services.payments import invoice_collect, invoice_send


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    fields = ["gpu_model", "mode", "priority_class", "rate_per_gpu_hour", "gpu_ms", "exact_amount", "amount"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            return super().get_queryset(request)


@admin.register(Invoice)
class InvoiceAdmin(UnscopedReadOnlyAdmin):
    list_display = ["id", "tenant", "month", "state", "total", "failure_count", "sent_at", "paid_at", "printable"]
    list_filter = ["state", "month"]
    search_fields = ["tenant__slug", "stripe_invoice_id"]
    inlines = [InvoiceLineInline]
    actions = ["send", "collect", "void"]

    @admin.display(description="view")
    def printable(self, invoice):
        return format_html('<a href="{}">print</a>', reverse("admin:billing_invoice_print", args=[invoice.pk]))

    def get_urls(self):
        from django.urls import path

        from .views import invoice_print_operator

        own = [
            path(
                "<int:invoice_id>/print/",
                self.admin_site.admin_view(invoice_print_operator),
                name="billing_invoice_print",
            )
        ]
        return own + super().get_urls()

    @admin.action(description="Send draft invoices to Stripe and collect")
    def send(self, request, queryset):
        self._each(request, queryset, lambda i: invoice_send(invoice_id=i.pk), "sent")

    @admin.action(description="Retry payment of failed invoices")
    def collect(self, request, queryset):
        self._each(request, queryset, lambda i: invoice_collect(invoice_id=i.pk), "collected")

    @admin.action(description="Void (charges go to the next invoice)")
    def void(self, request, queryset):
        self._each(request, queryset, lambda i: invoice_void(invoice=i, reason=f"voided by {request.user}"), "voided")

    def _each(self, request, queryset, fn, verb):
        done = 0
        for invoice in queryset:
            try:
                fn(invoice)
                done += 1
            except (InvoiceError, GatewayError) as exc:
                self.message_user(request, f"invoice {invoice.pk}: {exc}", messages.ERROR)
        self.message_user(request, f"{done} invoice(s) {verb}")


@admin.register(TenantDiscount)
class TenantDiscountAdmin(admin.ModelAdmin):
    """Effective-dated like prices: a discount applies to usage from its date, never to the past."""

    list_display = ["tenant", "percent", "effective_from", "effective_until", "note"]

    def get_queryset(self, request):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            return super().get_queryset(request)

    def changelist_view(self, request, extra_context=None):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            response = super().changelist_view(request, extra_context)
            return response.render() if hasattr(response, "render") else response

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            response = super().changeform_view(request, object_id, form_url, extra_context)
            return response.render() if hasattr(response, "render") else response


@admin.register(BillingPolicy)
class BillingPolicyAdmin(admin.ModelAdmin):
    list_display = ["payment_grace_days", "suspend_after_failures"]

    def has_add_permission(self, request):
        return not BillingPolicy.objects.exists()


@admin.register(StripeEvent)
class StripeEventAdmin(admin.ModelAdmin):
    list_display = ["event_id", "type", "received_at"]
    list_filter = ["type"]
    readonly_fields = ["event_id", "type", "received_at", "payload"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(UsageWindow)
class UsageWindowAdmin(UnscopedReadOnlyAdmin):
    list_display = ["job_id", "node", "attempt", "seq", "start_ms", "end_ms", "gpu_model", "mode", "gpu_ms", "amount"]
    list_filter = ["gpu_model", "mode"]
