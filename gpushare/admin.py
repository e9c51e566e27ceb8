"""Pieces every app's admin shares (the operator console is Django's admin)."""

from __future__ import annotations

from django_scopes import scopes_disabled


class UnscopedAdminMixin:
    """Platform-wide pages over tenant-owned rows: query, run and render each view with scopes disabled."""

    def _unscoped(self, view, *args, **kwargs):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            response = view(*args, **kwargs)
            if hasattr(response, "render") and not getattr(response, "is_rendered", True):
                response.render()
        return response

    def get_queryset(self, request):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            return super().get_queryset(request)

    def changelist_view(self, request, extra_context=None):
        return self._unscoped(super().changelist_view, request, extra_context)

    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        return self._unscoped(super().changeform_view, request, object_id, form_url, extra_context)

    def history_view(self, request, object_id, extra_context=None):
        return self._unscoped(super().history_view, request, object_id, extra_context)

    def response_action(self, request, queryset):
        with scopes_disabled():  # the operator's admin: every tenant's rows
            return super().response_action(request, queryset)


class ReadOnlyAdminMixin:
    """Rows the admin shows but never adds, changes or deletes (writes go through services)."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
