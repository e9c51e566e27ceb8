"""Pieces every REST endpoint shares: the error format, tenant scoping, pagination,
the error answers in the OpenAPI schema, and Django-level errors on /api/ paths.

Errors always look like ``{"error": {"code": ..., "message": ..., "fields": {...}}}``
with a stable ``code`` (ERROR_CODES): invalid, not_found, method_not_allowed,
not_acceptable, unsupported_media_type, quota_exceeded, budget_exhausted, budget_exceeded,
unauthenticated, forbidden, conflict, rate_limited, too_large, server_error.
docs/api.md has the table of codes and HTTP statuses.
"""

from __future__ import annotations

import contextlib
import time

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import Http404, JsonResponse
from django_scopes import scope
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiResponse
from rest_framework import exceptions, pagination, permissions, serializers, status
from rest_framework.renderers import BrowsableAPIRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from accounts.authentication import TokenPrincipal

from .throttling import rate_text

# HTTP status of a refusal from a service (JobError, EndpointError, ...) by its code.
SERVICE_STATUS = {
    "forbidden": 403,
    "conflict": 409,
    "quota_exceeded": 403,
    "budget_exhausted": 403,
    "budget_exceeded": 403,  # the new work's money hold does not fit in what is left (admission)
}


class ApiError(exceptions.APIException):
    """Raise from a view with a code and an HTTP status of your choosing."""

    def __init__(self, message: str, *, code: str = "invalid", status_code: int = 400, fields: dict | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.error_code = code
        self.fields = fields or {}

    @classmethod
    def from_service(cls, exc: Exception) -> ApiError:
        """A service's refusal (with ``code`` and an optional ``field``) in the API's error shape."""
        code = getattr(exc, "code", "invalid")
        field = getattr(exc, "field", None)
        return cls(
            str(exc), code=code, status_code=SERVICE_STATUS.get(code, 400), fields={field: [str(exc)]} if field else {}
        )


ERROR_CODES = (
    "invalid",
    "not_found",
    "method_not_allowed",
    "not_acceptable",
    "unsupported_media_type",
    "quota_exceeded",
    "budget_exhausted",
    "budget_exceeded",
    "unauthenticated",
    "forbidden",
    "conflict",
    "rate_limited",
    "too_large",
    "server_error",
)

_CODE_BY_STATUS = {
    400: "invalid",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
}


def _flatten(detail) -> str:
    if isinstance(detail, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in detail.items())
    if isinstance(detail, list):
        return " ".join(_flatten(v) for v in detail)
    return str(detail)


def _safe(value):
    """Error text may echo the input: make it encodable (a lone surrogate becomes ``\\ud800``)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_safe(k): _safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_safe(v) for v in value]
    return value


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
        fields = {k: [_flatten(m) for m in (v if isinstance(v, list) else [v])] for k, v in exc.detail.items()}
        message = "Invalid input: " + _flatten(exc.detail)
    else:
        message = _flatten(getattr(exc, "detail", str(exc)))
    if isinstance(exc, exceptions.NotAuthenticated):
        message = "Authentication required: send 'Authorization: Bearer <token>'."
    elif isinstance(exc, exceptions.Throttled):
        request = context.get("request")
        tenant_limit = getattr(getattr(request, "_request", request), "throttled_by_tenant", None)
        if tenant_limit:  # gpushare.throttling.TenantRateThrottle: the whole tenant's allowance
            message = (
                f"Too many requests for this tenant (limit api_requests_per_minute={tenant_limit}, "
                f"all its tokens and sessions together); retry in {exc.wait or 1:.0f} s."
            )
        else:
            message = f"Too many requests for this token ({rate_text()}); retry in {exc.wait or 1:.0f} s."
    body = {"error": {"code": code, "message": _safe(message), "fields": _safe(fields)}}
    response.data = body
    return response


class Pagination(pagination.PageNumberPagination):
    """``?page=N`` (from 1) and ``?page_size=N`` (default 50, at most 500)."""

    page_size_query_param = "page_size"
    max_page_size = 500


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

    def _tenant_scope_close(self) -> None:
        stack = getattr(self, "_tenant_scope", None)
        if stack is not None:
            stack.close()
            self._tenant_scope = None

    def finalize_response(self, request, response, *args, **kwargs):
        try:
            response = super().finalize_response(request, response, *args, **kwargs)
            if isinstance(getattr(response, "accepted_renderer", None), BrowsableAPIRenderer):
                response.render()  # the browsable API reads the tenant's rows as it renders (forms, filters)
            return response
        finally:
            self._tenant_scope_close()

    def dispatch(self, request, *args, **kwargs):
        # An exception no handler turns into a response skips finalize_response: without this, the
        # tenant's scope would stay active in the thread for whatever it serves next.
        try:
            return super().dispatch(request, *args, **kwargs)
        finally:
            self._tenant_scope_close()


def error_response(message: str, *, code: str, status_code: int = status.HTTP_400_BAD_REQUEST, fields=None):
    return Response({"error": {"code": code, "message": message, "fields": fields or {}}}, status=status_code)


# --- The error shape in the OpenAPI schema ----------------------------------


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.BearerTokenAuthentication"
    match_subclasses = True  # gpushare.throttling's, which the API uses
    name = "bearerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A tenant API token (gps_...), created in the portal: `Authorization: Bearer <token>`.",
        }


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.ChoiceField(choices=ERROR_CODES)
    message = serializers.CharField()
    fields = serializers.DictField(child=serializers.ListField(child=serializers.CharField()))


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


def _error_response(description: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorSerializer, description=description)


ERROR_RESPONSES = {
    400: _error_response("invalid: the request breaks a rule stated in the message."),
    401: _error_response("unauthenticated: no, unknown, revoked or expired token."),
    403: _error_response("forbidden / quota_exceeded: the token or tenant may not do this."),
    404: _error_response("not_found: no such object for this tenant."),
    409: _error_response("conflict: the object's state (or an Idempotency-Key) does not allow it."),
    413: _error_response("too_large: the request body is over the limit."),
    429: _error_response("rate_limited: too many requests for this token; see Retry-After."),
}


_ERROR_COMPONENT = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "enum": list(ERROR_CODES)},
                "message": {"type": "string"},
                "fields": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
            },
            "required": ["code", "message", "fields"],
        }
    },
    "required": ["error"],
}


def error_responses_hook(result, generator, request, public):
    """drf-spectacular postprocessing: every /api/v1/ operation documents the shared error answers.

    Any endpoint may answer 400 (bad query or body), 401, 403 (role, scope), 404,
    413 (body too large) or 429 (rate limit), always in the one error shape.
    """
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("ApiError", _ERROR_COMPONENT)
    ref = {"$ref": "#/components/schemas/ApiError"}
    for path, operations in result.get("paths", {}).items():
        if not path.startswith("/api/v1/"):
            continue
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status_code, response in ERROR_RESPONSES.items():
                responses.setdefault(
                    str(status_code),
                    {"description": response.description, "content": {"application/json": {"schema": ref}}},
                )
    return result


# --- Django-level errors on /api/ paths --------------------------------------


def _is_api(request) -> bool:
    return request.path.startswith("/api/")


def _json_error(status_code: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, "fields": {}}}, status=status_code)


# A refused body is read and thrown away (up to these bounds) before the 413 goes out.
DRAIN_MAX_BYTES = 1 << 30
DRAIN_MAX_S = 30.0


def _drain(request, length: int) -> bool:
    """Read and discard the request body; True when all of it was read within the bounds.

    A client that sends its whole body before it reads the answer (``requests``,
    most HTTP libraries) never sees a 413 sent early: the server closes a socket
    with unread data, the kernel resets the connection, and the client's send
    fails with a broken pipe. Reading the body first lets every client read the
    answer; past the bounds the answer says ``Connection: close``.
    """
    if length > DRAIN_MAX_BYTES:
        return False
    deadline = time.monotonic() + DRAIN_MAX_S
    left = length
    try:
        while left > 0 and time.monotonic() < deadline:
            chunk = request.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
    except OSError:
        return False
    return left == 0


class ApiBodyLimitMiddleware:
    """Refuse an /api/ request body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` with 413 in the error shape.

    DRF's parsers read the raw stream, so Django's own check never fires for them.
    The body is drained first (``_drain``) so that the client reads the 413
    instead of a reset connection.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and _is_api(request):
            raw = request.META.get("CONTENT_LENGTH") or "0"
            length = int(raw) if raw.isascii() and raw.isdigit() else -1
            if length < 0:
                response = _json_error(400, "invalid", "Content-Length must be a non-negative integer.")
                response["Connection"] = "close"
                return response
            if length > limit:
                response = _json_error(
                    413, "too_large", f"The request body is {length} bytes; the limit is {limit} bytes."
                )
                if not _drain(request, length):
                    response["Connection"] = "close"
                return response
        return self.get_response(request)


def page_not_found(request, exception=None):
    from django.views.defaults import page_not_found as html_404

    if _is_api(request):
        return _json_error(404, "not_found", f"No API endpoint at {request.path!r}; see /api/docs/.")
    return html_404(request, exception)


def bad_request(request, exception=None):
    from django.views.defaults import bad_request as html_400

    if _is_api(request):
        return _json_error(400, "invalid", "Bad request.")
    return html_400(request, exception)


def permission_denied(request, exception=None):
    from django.views.defaults import permission_denied as html_403

    if _is_api(request):
        return _json_error(403, "forbidden", "You may not do this.")
    return html_403(request, exception)


def server_error(request):
    from django.views.defaults import server_error as html_500

    if _is_api(request):
        return _json_error(500, "server_error", "Internal error; it has been logged.")
    return html_500(request)
