"""The operator's console for people and credentials. Tenants, plans, quotas and the audit
log are presented by the console app (console/admin.py), through accounts.services.

Every page here runs with django-scopes disabled (the operator sees all tenants), and
nothing writes except through a service, so each change leaves its audit row.
"""

from __future__ import annotations

from django.contrib import admin, messages

from gpushare.admin import ReadOnlyAdminMixin, UnscopedAdminMixin

from .models import ApiToken, Invitation, Membership
from .services import AccountsError, token_revoke


class UnscopedReadOnlyAdmin(UnscopedAdminMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """List and read tenant-owned rows across tenants; no add, change or delete."""


@admin.register(ApiToken)
class ApiTokenAdmin(UnscopedReadOnlyAdmin):
    list_display = [
        "prefix",
        "name",
        "tenant",
        "user",
        "scopes",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "user__username", "tenant__slug"]
    exclude = ["token_hash"]
    actions = ["revoke"]

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        revoked = 0
        for token in queryset.select_related("tenant"):
            try:
                token_revoke(token=token, actor=request.user)
                revoked += 1
            except AccountsError as exc:
                messages.error(request, f"{token.prefix}: {exc}")
        messages.success(request, f"Revoked {revoked} token(s).")

    def has_change_permission(self, request, obj=None):
        return request.user.is_staff and obj is None  # the action needs it; the form stays read-only


@admin.register(Membership)
class MembershipAdmin(UnscopedReadOnlyAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]


@admin.register(Invitation)
class InvitationAdmin(UnscopedReadOnlyAdmin):
    list_display = ["email", "tenant", "role", "invited_by", "created_at", "expires_at", "accepted_at"]
    list_filter = ["tenant", "role"]
    search_fields = ["email", "tenant__slug"]
    exclude = ["token_hash"]
