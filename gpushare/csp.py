"""The content security policy headers (django-csp), built once per process for the responses that take
them as the settings write them.

django-csp builds both headers (the policy and the report-only one) from the settings on every response:
~40 µs of a 0.57 ms API request (`python -m bench.profile_paths --cpu --paths trivial`, #19). A response
whose view changed nothing of the policy (no ``csp_update``/``csp_replace``/``csp_override``) and whose
page asked for no nonce gets the same two values every time: they are built once (by django-csp's own
``build_policy``) and kept until a setting changes (``setting_changed``: tests). Any other response is
django-csp's as is.
"""

from __future__ import annotations

from csp.constants import HEADER, HEADER_REPORT_ONLY
from csp.middleware import CheckableLazyObject, CSPMiddleware
from csp.utils import build_policy
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

# What a view sets on its response to change the policy (csp.decorators).
_PER_RESPONSE = ("_csp_config", "_csp_update", "_csp_replace", "_csp_config_ro", "_csp_update_ro", "_csp_replace_ro")

# (header, its value from the settings, the response attribute that exempts from it, its settings name)
_built: list[tuple[str, str, str, tuple[str, ...]]] = []


@receiver(setting_changed)
def _settings_changed(setting, **kwargs) -> None:
    if setting.startswith("CONTENT_SECURITY_POLICY") or setting == "DEBUG":
        _built.clear()


def _headers() -> list[tuple[str, str, str, tuple[str, ...]]]:
    if not _built:
        for header, report_only, exempt, name in (
            (HEADER, False, "_csp_exempt", "CONTENT_SECURITY_POLICY"),
            (HEADER_REPORT_ONLY, True, "_csp_exempt_ro", "CONTENT_SECURITY_POLICY_REPORT_ONLY"),
        ):
            prefixes = tuple((getattr(settings, name, None) or {}).get("EXCLUDE_URL_PREFIXES", None) or ())
            _built.append((header, build_policy(report_only=report_only), exempt, prefixes))
    return _built


class CachedCSPMiddleware(CSPMiddleware):
    """django-csp's middleware; the headers of a response that changes nothing of the policy come from
    :func:`_headers`, written under django-csp's own conditions (not exempt, not set already, not an
    excluded prefix; none on a debug error page)."""

    def process_response(self, request, response):
        if getattr(request, "_csp_nonce", None) is not None or any(hasattr(response, a) for a in _PER_RESPONSE):
            return super().process_response(request, response)
        if response.status_code in (404, 500) and settings.DEBUG:
            return response
        for header, value, exempt, prefixes in _headers():
            if (
                value
                and not getattr(response, exempt, False)
                and header not in response
                and not request.path_info.startswith(prefixes)
            ):
                response[header] = value
        # As django-csp does: a nonce asked for after the header is written is an error, not a silent gap.
        request.csp_nonce = CheckableLazyObject(self._csp_nonce_post_response)
        return response
