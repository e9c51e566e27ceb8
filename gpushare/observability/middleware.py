"""Every web request: a request id, the log context, and one log line when it is done.

The id is the caller's ``X-Request-ID`` when it looks like one (a proxy or a
CI pipeline that set it can follow the request through our logs), else a new
one; it is sent back in ``X-Request-ID``. Logs written while the request runs
carry it, with the tenant (bound when a token authenticates) and the job
(when the URL names one). The closing line, ``gpushare.request`` at INFO,
has the method, path, status, duration and user: the web server's
access log is off: it knows none of these. The duration is also sent back, as
``Server-Timing: app;dur=<ms>`` (browsers' developer tools show it; a client
that sees a slow call can tell the server's part from the network's), and
counted in the web's Prometheus series (``metrics.web_request_observe``: by
route, method and status, and the duration by route and method).
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from .context import log_context, log_context_bind, log_context_scope
from .metrics import web_request_observe

log = logging.getLogger("gpushare.request")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{8,64}")


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        given = request.META.get("HTTP_X_REQUEST_ID", "")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        request.request_id = request_id
        started = time.perf_counter()
        with log_context_scope(request_id=request_id):
            response = self.get_response(request)
            elapsed = time.perf_counter() - started
            elapsed_ms = elapsed * 1000
            match = getattr(request, "resolver_match", None)
            web_request_observe(
                view=getattr(match, "view_name", None),
                method=request.method,
                status=response.status_code,
                seconds=elapsed,
            )
            response["X-Request-ID"] = request_id
            response["Server-Timing"] = f"app;dur={elapsed_ms:.1f}"
            portal = getattr(request, "portal", None)
            tenant = getattr(getattr(portal, "tenant", None), "slug", None)
            if tenant and "tenant" not in log_context():
                log_context_bind(tenant=tenant)
            user = getattr(request, "user", None)
            log.info(
                "%s %s %s %.0fms",
                request.method,
                request.path,
                response.status_code,
                elapsed_ms,
                extra={"status": response.status_code, "user": getattr(user, "pk", None)},
            )
        return response

    def process_view(self, request, view_func, view_args, view_kwargs):
        match = getattr(request, "resolver_match", None)
        name = getattr(match, "url_name", "") or ""
        job = view_kwargs.get("job_id") or (view_kwargs.get("pk") if name.startswith("job") else None)
        if job is not None:
            log_context_bind(job=int(job) if str(job).isascii() and str(job).isdigit() else job)  # not "²"
        return None
