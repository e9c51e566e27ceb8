"""ORM queries compiled to SQL once, then run with new values: for the reads polled hardest.

Turning a ``.values()`` queryset into SQL costs Django 1-2 ms of CPU on every
request (joins, the select list, the WHERE tree, converters): more than the
indexed query itself costs PostgreSQL, and most of a job detail's time (#19).
A read whose *shape* never changes (a job by id; the first page of a tenant's
jobs) need not pay it each time: :class:`Prepared` builds the queryset once
per thread with **placeholders** for the values that change (distinct numbers
and moments no real row has), records where each lands among the compiled
parameters, and from then on runs the same SQL with the real values in those
places, applying the same converters Django would (e.g. JSON columns).

The ORM stays the one definition of the query: the SQL is Django's own.
Tenancy stays closed: the build runs inside a django-scopes scope of a
placeholder tenant, so every tenant condition, the scope's included, takes the
caller's tenant; a placeholder that does not land in the parameters (the build
did not use it) is an error at the first run, not a query without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.db.models import QuerySet
from django_scopes import scope

_EPOCH = datetime(1901, 1, 1, tzinfo=UTC)


def placeholder(name: str, index: int, kind: type):
    """A value no real row or request has, that marks where ``name`` lands in the parameters."""
    if kind is datetime:
        return _EPOCH + timedelta(microseconds=7919 * (index + 1))
    return -(2**62) - 7919 * (index + 1)


class Prepared:
    """``build(shape, **values)`` -> a ``.values()`` QuerySet; :meth:`rows` runs it with real values.

    ``shape``: what changes the SQL itself (e.g. a page's direction and size), compiled once per
    distinct shape; ``kinds`` names each value's type (``int`` by default; ``datetime`` for
    moments); ``tenant`` names the value that is the tenant id (the scope the build runs in).
    """

    SHAPES_KEPT = 64  # per thread and query

    def __init__(self, build: Callable[..., QuerySet], *, tenant: str = "tenant_id", kinds: dict | None = None):
        self.build, self.tenant = build, tenant
        self.kinds = {tenant: int, **(kinds or {})}
        self._local = threading.local()

    def _compiled(self, shape, names: tuple[str, ...]):
        cache = self._local.__dict__.setdefault(connection.alias, {})
        found = cache.get((shape, names))
        if found is None:
            values = {name: placeholder(name, i, self.kinds.get(name, int)) for i, name in enumerate(names)}
            by_value = {value: name for name, value in values.items()}
            with scope(tenant=values[self.tenant]):
                queryset = self.build(shape, **values)
            compiler = queryset.query.get_compiler(connection=connection)
            sql, params = compiler.as_sql()
            slots = [(by_value.get(p) if isinstance(p, int | datetime) else None, p) for p in params]
            missing = set(names) - {name for name, _ in slots if name}
            if missing:
                raise ValueError(f"prepared query: {sorted(missing)} not among the compiled parameters")
            query = queryset.query
            columns = [*query.extra_select, *query.values_select, *query.annotation_select]
            fields = [s[0] for s in compiler.select[: compiler.col_count]]
            found = (sql, slots, columns, compiler, compiler.get_converters(fields))
            if len(cache) >= self.SHAPES_KEPT:
                cache.clear()
            cache[(shape, names)] = found
        return found

    def rows(self, shape=None, **values) -> list[dict]:
        """The rows, as ``.values()`` gives them, for this shape and these values (every name the build
        takes but ``shape``). Elsewhere than on PostgreSQL (the SQLite demo adapts moments to text) the
        ORM runs as usual."""
        if connection.vendor != "postgresql":
            with scope(tenant=values[self.tenant]):
                return list(self.build(shape, **values))
        sql, slots, columns, compiler, converters = self._compiled(shape, tuple(sorted(values)))
        params = [values[name] if name else fixed for name, fixed in slots]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        if converters:
            rows = compiler.apply_converters(map(list, rows), converters)
        return [dict(zip(columns, row, strict=True)) for row in rows]
