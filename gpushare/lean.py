"""A lighter dispatch for a DRF view's busiest calls: the view's own handler, without DRF's per-request wrapping.

A CI fleet's submits and polls all look alike: ``Authorization: Bearer``, a JSON body (or none),
``Accept: application/json``. For those, DRF's ``APIView.dispatch`` builds a ``Request`` around the
Django request (its lazy parsers, authenticators and negotiator), negotiates the renderer, runs the
authentication loop, wraps the answer in a ``Response`` and renders it through the renderer's context.
Served without that: 0.07-0.15 ms less CPU a call in process (docs/benchmarks.md, Session 18).

:class:`LeanDispatchMixin` serves such a call with the same parts, called directly:

- the token check, with the view's rate limits counted in the same Redis round trip
  (``accounts.authentication.bearer_accept``, what the API's authentication class calls);
- the view's own permission and throttle checks (``check_permissions``, ``check_throttles``), in DRF's order;
- the body parsed by the API's strict JSON parser, only when the handler reads it;
- the handler itself (``create``, ``retrieve``...), unchanged, inside the tenant's scope;
- errors through the view's ``handle_exception`` (the one error shape, ``WWW-Authenticate``,
  ``Retry-After``), and the answer written by the API's JSON renderer with DRF's ``Allow`` and
  ``Vary`` headers.

Anything else takes DRF's own dispatch: another ``Accept`` (pretty printing, the browsable API), a
``?format=``, another body type, a session, a malformed ``Authorization``, a forced test login. The
answers are the same either way; the tests in tests/api/test_lean_dispatch.py send each call down both.
"""

from __future__ import annotations

import io

from django.http import HttpResponse
from django.utils.cache import patch_vary_headers
from django_scopes import scope
from rest_framework import exceptions
from rest_framework.response import Response

from accounts.authentication import TokenRejected, bearer_accept, bearer_parts

from .parsers import StrictJSONParser
from .renderers import FastJSONRenderer
from .throttling import rates_for_view

# What the API's clients send (the SDK and CLI: application/json; curl, requests and httpx: */*);
# each picks the JSON renderer on DRF's path too.
JSON_ACCEPTS = frozenset({"", "*/*", "application/json", "application/json, */*", "application/json,*/*"})
JSON_BODIES = frozenset({"application/json", "application/json; charset=utf-8", "application/json;charset=utf-8"})

_UNREAD = object()
_renderer = FastJSONRenderer()
_parser = StrictJSONParser()


def _bearer_token(request) -> str | None:
    """The token of a well-formed ``Authorization: Bearer <token>``, else None (DRF's path says why)."""
    parts = bearer_parts(request.META.get("HTTP_AUTHORIZATION", ""))
    return parts[1] if parts is not None and len(parts) == 2 else None


def _lean_eligible(request) -> bool:
    meta = request.META
    if meta.get("HTTP_ACCEPT", "") not in JSON_ACCEPTS or "format" in request.GET:
        return False
    if getattr(request, "_force_auth_user", None) or getattr(request, "_force_auth_token", None):  # a test login
        return False
    length = meta.get("CONTENT_LENGTH") or "0"
    return length == "0" or meta.get("CONTENT_TYPE", "").lower() in JSON_BODIES


class LeanRequest:
    """What a view's handler, permissions, throttles and error handler read of DRF's ``Request``;
    the rest is the Django request's (as DRF's own ``Request`` proxies it)."""

    def __init__(self, request):
        self._request = request
        self.method = request.method
        self.query_params = request.GET
        self.user = None
        self.auth = None
        self.accepted_renderer = _renderer
        self.accepted_media_type = "application/json"
        self.version = self.versioning_scheme = None
        self.authenticators = ()  # authenticated before any check: a refusal is a 403, never "log in"
        self._data = _UNREAD

    @property
    def data(self):
        """The JSON body, parsed on first read (DRF's ``{}`` for an empty body); a bad body is a 400."""
        if self._data is _UNREAD:
            request = self._request
            body = request.body
            if body:
                context = {"request": self, "encoding": "utf-8"}
                self._data = _parser.parse(io.BytesIO(body), "application/json", context)
            else:
                self._data = {}
        return self._data

    def force_plaintext_errors(self, value) -> None:  # DRF's uncaught-exception path (DEBUG)
        pass

    def __getattr__(self, name):
        return getattr(self._request, name)


class LeanDispatchMixin:
    """Serve the view's ``lean_actions`` (``{"create", "retrieve"}``, say) without DRF's per-request wrapping
    when the call is a plain bearer-token JSON call; see the module's docstring. First among the view's
    bases: its ``dispatch`` answers before ``TenantScopedMixin``'s, and enters the tenant's scope itself."""

    lean_actions: frozenset[str] = frozenset()

    def dispatch(self, request, *args, **kwargs):
        action = getattr(self, "action_map", {}).get(request.method.lower())
        if action in self.lean_actions and _lean_eligible(request):
            token = _bearer_token(request)
            if token is not None:
                return self._lean_dispatch(request, action, token, args, kwargs)
        return super().dispatch(request, *args, **kwargs)

    def _lean_dispatch(self, django_request, action, token, args, kwargs):
        self.args, self.kwargs = args, kwargs
        self.action = action
        self.format_kwarg = None
        self.headers = self.default_response_headers
        self.request = request = LeanRequest(django_request)
        try:
            try:
                user, principal = bearer_accept(django_request, token, rates_for_view(self, request))
            except TokenRejected as exc:
                raise exceptions.AuthenticationFailed(str(exc)) from exc
            # On the Django request too, as DRF's Request sets them (what middleware and logs read).
            request.user = django_request.user = user
            request.auth = django_request.auth = principal
            self.check_permissions(request)
            self.check_throttles(request)
            with scope(tenant=request.auth.tenant):
                response = getattr(self, action)(request, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - what DRF's dispatch catches: its handler answers or re-raises
            response = self.handle_exception(exc)
        return self._lean_response(response)

    def _lean_response(self, response):
        if not isinstance(response, Response):
            return response
        answer = HttpResponse(
            _renderer.render(response.data), status=response.status_code, content_type="application/json"
        )
        for key, value in response.items():
            if key != "Content-Type":
                answer[key] = value
        vary = self.headers.pop("Vary", None)  # as DRF's finalize_response: added to, not overwriting
        if vary is not None:
            patch_vary_headers(answer, [v.strip() for v in vary.split(",")])
        for key, value in self.headers.items():
            answer[key] = value
        return answer
