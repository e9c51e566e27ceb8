"""Keyset (cursor) pagination for lists that grow without bound (jobs): no ``COUNT(*)``, no OFFSET.

A page is ``ORDER BY submitted_at DESC, id DESC LIMIT n+1`` after the row the
cursor names (``(submitted_at, id) < (t, i)``), an index range scan whatever
the history, so page 1000 costs what page 1 costs. Rows inserted while a
client pages (newer ones) never shift the pages it has not read yet: nothing is
repeated or skipped. ``?cursor=`` is opaque (base64url of JSON); a cursor that
does not decode is a 400 in the API's error shape. There is no ``count``: a
count over the tenant's whole history is what made the list slow (see
docs/api.md).
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime

from django.utils.dateparse import parse_datetime
from rest_framework.pagination import BasePagination
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


def _error(message: str, field: str):
    from .api import ApiError

    return ApiError(message, fields={field: [message]})


def cursor_encode(direction: str, at: datetime, pk: int) -> str:
    raw = json.dumps({"d": direction, "t": at.isoformat(), "i": pk}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_decode(text: str) -> tuple[str, datetime, int]:
    """``(direction, submitted_at, id)`` of a cursor, or ApiError (400)."""
    bad = _error("cursor is not a cursor this API gave out: follow the 'next' or 'previous' link", "cursor")
    if not text or len(text) > 200 or not text.isascii():
        raise bad
    try:
        data = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(data, dict) or data.get("d") not in ("n", "p"):
        raise bad
    pk, at = data.get("i"), data.get("t")
    if isinstance(pk, bool) or not isinstance(pk, int) or not 0 < pk < 2**63 or not isinstance(at, str):
        raise bad
    try:
        moment = parse_datetime(at)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise bad
    return data["d"], moment, pk


class KeysetPagination(BasePagination):
    """``?cursor=`` (from ``next`` / ``previous``) and ``?page_size=N`` (default 50, at most 500), newest first.
    The queryset may be of model instances or of ``.values()`` rows (that include ``id``)."""

    page_size = DEFAULT_PAGE_SIZE
    max_page_size = MAX_PAGE_SIZE
    time_field = "submitted_at"

    def page_size_for(self, request) -> int:
        raw = request.query_params.get("page_size")
        if raw is None:
            return self.page_size
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= 10**6:
            raise _error(f"page_size must be a whole number from 1 to {self.max_page_size}", "page_size")
        return min(int(raw), self.max_page_size)

    def window(self, request) -> tuple[str, tuple[datetime, int] | None, int]:
        """``(direction, key, size)`` the request asks for: ``n`` (older than ``key``, or the newest when
        ``key`` is None) or ``p`` (newer than ``key``), ``size`` rows; ApiError (400) for a bad one."""
        if "page" in request.query_params:
            raise _error("this list pages by cursor: follow the 'next' link (there is no ?page=)", "page")
        size = self.page_size_for(request)
        raw = request.query_params.get("cursor")
        if raw is None:
            return "n", None, size
        direction, at, pk = cursor_decode(raw)
        return direction, (at, pk), size

    @classmethod
    def ordered(cls, queryset, direction: str, key: tuple[datetime, int] | None, size: int):
        """The query of a page: one more row than ``size``, to know whether there are more."""
        table, field = queryset.model._meta.db_table, cls.time_field
        column = queryset.model._meta.get_field(field).column
        if key is None:
            ordered = queryset.order_by(f"-{field}", "-id")
        elif direction == "n":
            ordered = queryset.extra(where=[f'("{table}"."{column}", "{table}"."id") < (%s, %s)'], params=list(key))
            ordered = ordered.order_by(f"-{field}", "-id")
        else:
            ordered = queryset.extra(where=[f'("{table}"."{column}", "{table}"."id") > (%s, %s)'], params=list(key))
            ordered = ordered.order_by(field, "id")
        return ordered[: size + 1]

    def paginate_queryset(self, queryset, request, view=None):
        direction, key, size = self.window(request)
        return self.paginate_rows(list(self.ordered(queryset, direction, key, size)), request, direction, key, size)

    def paginate_rows(self, rows: list, request, direction: str, key, size: int) -> list:
        """The page from the rows of :meth:`ordered`'s query (run by the caller: e.g. a prepared query)."""
        more = len(rows) > size
        rows = rows[:size]
        if direction == "p":
            rows.reverse()
            has_next, has_previous = True, more
        else:
            has_next, has_previous = more, key is not None
        self.request = request
        self.next_cursor = cursor_encode("n", *self._key(rows[-1])) if has_next and rows else None
        self.previous_cursor = cursor_encode("p", *self._key(rows[0])) if has_previous and rows else None
        return rows

    def _key(self, row) -> tuple[datetime, int]:
        """A row's place in the order: a model instance, or a ``.values()`` row (with ``id``)."""
        if isinstance(row, dict):
            return row[self.time_field], row["id"]
        return getattr(row, self.time_field), row.pk

    def _link(self, cursor: str | None) -> str | None:
        if cursor is None:
            return None
        url = self.request.build_absolute_uri()
        return replace_query_param(url, "cursor", cursor)

    def get_paginated_response(self, data):
        return Response(
            {"next": self._link(self.next_cursor), "previous": self._link(self.previous_cursor), "results": data}
        )

    def get_paginated_response_schema(self, schema):
        return {
            "type": "object",
            "required": ["next", "previous", "results"],
            "properties": {
                "next": {"type": "string", "nullable": True, "format": "uri", "description": "Older jobs."},
                "previous": {"type": "string", "nullable": True, "format": "uri", "description": "Newer jobs."},
                "results": schema,
            },
        }

    def get_schema_operation_parameters(self, view):
        return [
            {
                "name": "cursor",
                "required": False,
                "in": "query",
                "description": "Opaque position from the 'next' or 'previous' link (keyset pagination).",
                "schema": {"type": "string"},
            },
            {
                "name": "page_size",
                "required": False,
                "in": "query",
                "description": f"Results per page (default {self.page_size}, at most {self.max_page_size}).",
                "schema": {"type": "integer", "minimum": 1, "maximum": self.max_page_size},
            },
        ]
