"""Content negotiation that remembers its answers: DRF's, kept per (renderer classes, format, Accept header).

DRF parses the ``Accept`` header and matches it against every renderer on each request (~20 us of an API
request's CPU); the answer depends only on the view's renderer classes, the format asked for (``.json``
suffix or ``?format=``) and the header's text, and the few clients of an API send the same few headers.
Answers are kept for at most ``MAX_ANSWERS`` such keys (least recently used out first); a request that is
refused (406, or 404 for an unknown format) is worked out again every time.
"""

from __future__ import annotations

from rest_framework.negotiation import DefaultContentNegotiation

from .caches import LockedLRU

MAX_ANSWERS = 256

_answers = LockedLRU(MAX_ANSWERS)


class RememberingContentNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        override = self.settings.URL_FORMAT_OVERRIDE
        key = (
            tuple(type(renderer) for renderer in renderers),
            format_suffix or (request.query_params.get(override) if override else None),
            request.META.get("HTTP_ACCEPT", "*/*"),
        )
        answer = _answers.get(key)
        if answer is None:
            renderer, media_type = super().select_renderer(request, renderers, format_suffix)
            answer = (renderers.index(renderer), media_type)
            _answers.put(key, answer)
        index, media_type = answer
        return renderers[index], media_type
