"""What answers on /api/ paths outside the REST views, always in the API's error shape:
unknown paths (404, whatever DEBUG says), a request Django refuses to read (400), exceptions no view
handled (500), CSRF failures (403)."""

from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied, SuspiciousOperation
from django.http import Http404
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt

from .api import _is_api, _json_error, _safe

log = logging.getLogger(__name__)


class ApiExceptionMiddleware:
    """An exception no view handled, on an /api/ path: a 500 in the error shape, even with DEBUG on
    (Django would answer its HTML debug page). The traceback goes to the log."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not _is_api(request) or isinstance(exception, Http404 | PermissionDenied):
            return None
        if isinstance(exception, SuspiciousOperation):  # a body past Django's limits (too many form fields...)
            log.warning("Refused request on %s %s: %s", request.method, request.path, exception)
            return _json_error(400, "invalid", f"The request was refused: {_safe(str(exception))}")
        log.error("Internal error on %s %s", request.method, request.path, exc_info=exception)
        return _json_error(500, "server_error", "Internal error; it has been logged.")


@csrf_exempt
def api_not_found(request, rest: str = ""):
    """Any /api/ path no endpoint serves (the last /api/ URL pattern): a 404 in the error shape,
    whatever DEBUG says, with a hint when only the trailing slash is missing."""
    message = f"No API endpoint at {_safe(request.path)!r}; see /api/docs/."
    if not request.path.endswith("/"):
        try:
            resolved = resolve(request.path + "/")
        except Resolver404:
            resolved = None
        if resolved is not None and resolved.func is not api_not_found:
            message = f"No API endpoint at {_safe(request.path)!r}: API paths end with a slash ({request.path}/)."
    return _json_error(404, "not_found", message)


def csrf_failure(request, reason: str = ""):
    """CSRF_FAILURE_VIEW: the error shape on /api/ paths, Django's page elsewhere."""
    from django.views.csrf import csrf_failure as html_csrf_failure

    if _is_api(request):
        return _json_error(403, "forbidden", f"CSRF check failed: {reason}")
    return html_csrf_failure(request, reason=reason)
