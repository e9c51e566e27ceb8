"""Pieces every REST endpoint shares: the error format and tenant scoping.

Errors always look like ``{"error": {"code": ..., "message": ..., "fields": {...}}}``
with a stable ``code``: invalid, not_found, quota_exceeded, budget_exhausted,
unauthenticated, forbidden, conflict, rate_limited.
"""

from __future__ import annotations

import contextlib

from django.core.exceptions import PermissionDenied
from django.http import Http404
from django_scopes import scope
from rest_framework import exceptions, permissions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from accounts.authentication import TokenPrincipal


class ApiError(exceptions.APIException):
    """Raise from a view with a code and an HTTP status of your choosing."""

    def __init__(self, message: str, *, code: str = "invalid", status_code: int = 400, fields: dict | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.error_code = code
        self.fields = fields or {}


_CODE_BY_STATUS = {
    400: "invalid",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "invalid",
    406: "invalid",
    409: "conflict",
    413: "invalid",
    415: "invalid",
    429: "rate_limited",
}


def _flatten(detail) -> str:
    if isinstance(detail, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in detail.items())
    if isinstance(detail, list):
        return " ".join(_flatten(v) for v in detail)
    return str(detail)


def exception_handler(exc, context):
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    code = getattr(exc, "error_code", None) or _CODE_BY_STATUS.get(response.status_code, "invalid")
    fields: dict = getattr(exc, "fields", None) or {}
    if isinstance(exc, exceptions.ValidationError) and isinstance(exc.detail, dict):
        fields = {k: [str(m) for m in (v if isinstance(v, list) else [v])] for k, v in exc.detail.items()}
        message = "Invalid input: " + _flatten(exc.detail)
    else:
        message = _flatten(getattr(exc, "detail", str(exc)))
    if isinstance(exc, exceptions.NotAuthenticated):
        message = "Authentication required: send 'Authorization: Bearer <token>'."
    body = {"error": {"code": code, "message": message, "fields": fields}}
    response.data = body
    return response


class HasTenant(permissions.BasePermission):
    """The request is authenticated as a tenant principal (an API token)."""

    message = "This endpoint needs a tenant API token."

    def has_permission(self, request, view):
        return isinstance(request.auth, TokenPrincipal)


class TokenScope(permissions.BasePermission):
    """The token carries the scope the view asks for (``required_scopes``)."""

    def has_permission(self, request, view):
        principal = request.auth
        if not isinstance(principal, TokenPrincipal):
            return False
        method_scopes = getattr(view, "required_scopes", {})
        needed = method_scopes.get(request.method) or method_scopes.get("*")
        if needed and needed not in principal.scopes:
            self.message = f"This token lacks the '{needed}' scope."
            return False
        return True


class TenantScopedMixin:
    """Run the whole request inside the tenant's django-scopes scope.

    Any query on a tenant-owned model then sees only this tenant's rows, and a
    query made outside a scope raises: tenancy fails closed.
    """

    permission_classes = [permissions.IsAuthenticated, HasTenant, TokenScope]

    @property
    def tenant(self):
        return self.request.auth.tenant

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        self._tenant_scope = contextlib.ExitStack()
        self._tenant_scope.enter_context(scope(tenant=request.auth.tenant))

    def finalize_response(self, request, response, *args, **kwargs):
        stack = getattr(self, "_tenant_scope", None)
        if stack is not None:
            stack.close()
            self._tenant_scope = None
        return super().finalize_response(request, response, *args, **kwargs)


def error_response(message: str, *, code: str, status_code: int = status.HTTP_400_BAD_REQUEST, fields=None):
    return Response({"error": {"code": code, "message": message, "fields": fields or {}}}, status=status_code)
