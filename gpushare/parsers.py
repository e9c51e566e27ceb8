"""A JSON parser that refuses what PostgreSQL or the renderer would choke on later.

- lone surrogates (``"\\ud800"`` is valid JSON but not valid Unicode text);
- nesting deep enough to exhaust the decoder's recursion.

Both become a 400 ``invalid`` instead of a 500. Kept apart from gpushare/api.py
because DRF imports parser classes while ``rest_framework.views`` is imported.
"""

from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError


def _all_text_valid(value, depth: int = 0) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_all_text_valid(k, depth + 1) and _all_text_valid(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_all_text_valid(v, depth + 1) for v in value)
    return True


class StrictJSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError as exc:
            raise ParseError("JSON parse error - the document is nested too deeply.") from exc
        if not _all_text_valid(data):
            raise ParseError("JSON parse error - strings must be valid Unicode (no lone surrogate escapes).")
        return data
