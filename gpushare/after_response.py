"""Work a request starts but its client need not wait for: run once the response has been sent.

A submit asks for a scheduling pass, a state change queues its webhook sends: each is a message to
a worker (a Redis round trip, and a Celery publish when none is queued yet), which a client waited
for although its answer did not depend on it. Inside a request, :func:`after_response` keeps the
call until the response is closed (the WSGI server calls ``close()`` once it has written the body;
Django then sends ``request_finished``); anywhere else (a worker, a command, a shell) it runs at once.

What is kept is what a periodic task would also do, a little later: if the process dies between
the response and the call, the scheduler's beat pass (5 s) and the due-deliveries beat (5 s) do it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.core.signals import request_finished
from django.dispatch import receiver

log = logging.getLogger(__name__)
_local = threading.local()


def after_response(call: Callable[[], object]) -> None:
    """Run ``call`` once this thread's response is sent; outside a request, now."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        call()
    else:
        pending.append(call)


def _run_pending() -> None:
    pending, _local.pending = getattr(_local, "pending", None), None
    for call in pending or ():
        try:
            call()
        except Exception:  # one failed kick must not keep the others (each has its beat to fall back on)
            log.exception("a call kept for after the response failed")


@receiver(request_finished, dispatch_uid="gpushare.after_response")
def _request_finished(**kwargs) -> None:
    _run_pending()


class AfterResponseMiddleware:
    """Opens the request's list of calls kept for after its response (first in ``MIDDLEWARE``)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        _run_pending()  # a response never closed (a server that skipped close()) leaves none behind
        _local.pending = []
        return self.get_response(request)
