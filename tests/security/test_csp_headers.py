"""The policy headers from gpushare.csp (built once per process) are django-csp's own, response by response."""

from __future__ import annotations

import pytest
from csp.constants import HEADER, HEADER_REPORT_ONLY, NONCE
from csp.decorators import csp_exempt
from csp.middleware import CSPMiddleware
from django.http import HttpResponse
from django.test import RequestFactory, override_settings

from gpushare.csp import CachedCSPMiddleware


def both(view, path="/api/v1/"):
    """The response of ``view`` through django-csp's middleware and through ours."""
    out = []
    for middleware in (CSPMiddleware, CachedCSPMiddleware):
        request = RequestFactory().get(path)
        out.append(middleware(view)(request))
    return out


def plain(request):
    return HttpResponse("ok")


def test_a_plain_response_gets_django_csps_headers_and_the_second_the_same(settings):
    theirs, ours = both(plain)
    assert ours[HEADER] == theirs[HEADER] and "default-src 'self'" in ours[HEADER]
    assert ours.get(HEADER_REPORT_ONLY) == theirs.get(HEADER_REPORT_ONLY)
    _, again = both(plain)
    assert again[HEADER] == theirs[HEADER]


def test_a_view_that_changes_the_policy_or_asks_a_nonce_is_django_csps(settings):
    from csp.decorators import csp_update

    updated = csp_update({"style-src": ["'unsafe-inline'"]})(plain)
    theirs, ours = both(updated)
    assert ours[HEADER] == theirs[HEADER] and "'unsafe-inline'" in ours[HEADER]

    def with_nonce(request):
        return HttpResponse(str(request.csp_nonce))

    policy = {"DIRECTIVES": {"default-src": ["'self'"], "script-src": ["'self'", NONCE]}}
    with override_settings(CONTENT_SECURITY_POLICY=policy):
        _, ours = both(with_nonce)
        assert f"'nonce-{ours.content.decode()}'" in ours[HEADER]  # this response's own nonce
        _, next_one = both(with_nonce)
        assert next_one[HEADER] != ours[HEADER]


def test_exempt_responses_and_headers_already_set_are_left_alone():
    _, ours = both(csp_exempt()(plain))
    assert HEADER not in ours

    def own(request):
        response = HttpResponse("ok")
        response[HEADER] = "default-src 'none'"
        return response

    _, ours = both(own)
    assert ours[HEADER] == "default-src 'none'"


def test_a_changed_setting_is_the_next_responses_policy():
    _, before = both(plain)
    policy = {"DIRECTIVES": {"default-src": ["'self'", "https://cdn.example"]}}
    with override_settings(CONTENT_SECURITY_POLICY=policy):
        theirs, ours = both(plain)
        assert ours[HEADER] == theirs[HEADER] and "https://cdn.example" in ours[HEADER]
    _, after = both(plain)
    assert after[HEADER] == before[HEADER]


def test_a_nonce_asked_after_the_header_is_written_is_an_error():
    from csp.exceptions import CSPNonceError

    request = RequestFactory().get("/api/v1/")
    CachedCSPMiddleware(plain)(request)
    with pytest.raises(CSPNonceError):
        str(request.csp_nonce)
