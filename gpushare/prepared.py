"""Statements compiled once, then run with new values: for the reads polled hardest and the submit.

:class:`ServerStatement`: a statement PostgreSQL parses and plans once per connection. The
submit's admission read and its insert cost the server more to plan than to run (0.55 and 0.43 ms
as text, 0.24 and 0.18 ms prepared, measured one by one on a quiet machine, #19).

:class:`Prepared`:
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

import functools
import itertools
import re
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, models
from django.db.backends.signals import connection_created
from django.db.models import QuerySet
from django_scopes import scope

_EPOCH = datetime(1901, 1, 1, tzinfo=UTC)


def placeholder(name: str, index: int, kind: type):
    """A value no real row or request has, that marks where ``name`` lands in the parameters."""
    if kind is datetime:
        return _EPOCH + timedelta(microseconds=7919 * (index + 1))
    return -(2**62) - 7919 * (index + 1)


_by_sql: dict[str, ServerStatement] = {}


def _statement(sql: str) -> ServerStatement:
    """One :class:`ServerStatement` per text, whichever thread compiled it (one name, prepared once per
    connection), so that a shape compiled again (a thread's cache emptied) is not prepared again."""
    found = _by_sql.get(sql)
    return found if found is not None else _by_sql.setdefault(sql, ServerStatement(sql))


class Prepared:
    """``build(shape, **values)`` -> a ``.values()`` QuerySet; :meth:`rows` runs it with real values,
    planned by the server once per connection (:class:`ServerStatement`).

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
            found = (_statement(sql), slots, columns, compiler, compiler.get_converters(fields))
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
        statement, slots, columns, compiler, converters = self._compiled(shape, tuple(sorted(values)))
        params = [values[name] if name else fixed for name, fixed in slots]
        with connection.cursor() as cursor:
            statement.execute(cursor, params)
            rows = cursor.fetchall()
        if converters:
            rows = compiler.apply_converters(map(list, rows), converters)
        return [dict(zip(columns, row, strict=True)) for row in rows]


# --- statements the server plans once per connection ----------------------------------------------------

_PLACEHOLDER = re.compile(r"%%|%s|%\((\w+)\)s")
_names = itertools.count(1)


class ServerStatement:
    """A statement written with psycopg2's placeholders (``%s`` or ``%(name)s``, not both), which on
    PostgreSQL is sent once per connection as ``PREPARE`` and then run as ``EXECUTE`` with each call's
    values: PostgreSQL parses and plans it once, not at every call. The platform's connections ask for
    that one generic plan from the first run (``plan_cache_mode``, gpushare/settings/base.py); left to its
    own rule, PostgreSQL plans the first five runs on each connection again for their values.

    What a connection has prepared is kept on Django's connection object and forgotten when a new
    connection is made (``connection_created``); a prepared statement outlives a rolled-back
    transaction. A statement's result columns must be named, not ``*``: a column added by a
    migration would otherwise fail the prepared plan of a running server ("cached plan must not
    change result type"). Elsewhere than on PostgreSQL, or with ``DB_SERVER_PREPARED`` off (a pooler
    in transaction mode), the text is run as is.
    """

    def __init__(self, sql: str):
        self.sql = sql
        self.name = f"gpushare_{next(_names)}"
        order: list[str | int] = []

        def numbered(match: re.Match) -> str:
            if match.group(0) == "%%":
                return "%"
            key = match.group(1) if match.group(1) else len(order)
            if key not in order or isinstance(key, int):
                order.append(key)
            return f"${order.index(key) + 1}"

        self._server_sql = _PLACEHOLDER.sub(numbered, sql)
        self._order = order
        if any(isinstance(k, str) for k in order) and any(isinstance(k, int) for k in order):
            raise ValueError("a statement's placeholders are all %s or all %(name)s")

    def execute(self, cursor, params: list | tuple | Mapping) -> None:
        """Run it on ``cursor`` (a Django cursor) with ``params``; fetch as usual."""
        if not server_side(cursor):
            cursor.execute(self.sql, params)
            return
        self.prepare(cursor)
        values = self.values(params)
        cursor.execute(self.execute_sql(values), values)

    def prepare(self, cursor) -> None:
        """``PREPARE`` it on ``cursor``'s connection, unless that connection has already."""
        prepared = cursor.db.__dict__.setdefault("gpushare_prepared", set())
        if self.name not in prepared:
            cursor.execute(f"PREPARE {self.name} AS {self._server_sql}")
            prepared.add(self.name)

    def values(self, params: list | tuple | Mapping) -> list:
        """``params`` in the order of the server-side statement's ``$n`` placeholders."""
        values = [params[k] for k in self._order] if isinstance(params, Mapping) else list(params)
        if len(values) != len(self._order):
            raise ValueError(f"{self.name}: {len(self._order)} values expected, {len(values)} given")
        return values

    def execute_sql(self, values: list) -> str:
        """The ``EXECUTE`` of it, with a placeholder for each of ``values``."""
        return f"EXECUTE {self.name} ({', '.join(['%s'] * len(values))})" if values else f"EXECUTE {self.name}"


def positional_named(sql: str, prefix: str) -> str:
    """``sql`` with its ``%s`` placeholders named ``%(<prefix>0)s``, ``%(<prefix>1)s``, ... in order (``%%``
    kept): for a statement with positional values sent inside one with named ones (a statement's
    placeholders are all of one kind)."""
    count = itertools.count()
    return re.sub(r"%%|%s", lambda m: m.group(0) if m.group(0) == "%%" else f"%({prefix}{next(count)})s", sql)


def server_side(cursor) -> bool:
    """Whether statements run on ``cursor``'s connection as prepared ones (PostgreSQL, unless
    ``DB_SERVER_PREPARED`` is off); ``cursor.db`` is this thread's connection (``django.db.connection``
    is only a proxy to it)."""
    return cursor.db.vendor == "postgresql" and settings.GPUSHARE["DB_SERVER_PREPARED"]


def execute_in_turn(cursor, statements: list[tuple[ServerStatement, list | tuple | Mapping]]) -> None:
    """Run ``statements`` (each with its values) one after another in one round trip to the server; fetch the
    last one's rows as usual (the others' are discarded). Each still runs as a statement of its own: under
    READ COMMITTED each takes its own snapshot when it starts, so a statement after one that waited for a
    lock sees what committed meanwhile, as it would if sent on its own. With server-side statements:
    ``EXECUTE a(...); EXECUTE b(...)`` (each prepared first if this connection has not yet); elsewhere one
    statement at a time."""
    if not server_side(cursor):
        for statement, params in statements:
            statement.execute(cursor, params)
        return
    texts, values = [], []
    for statement, params in statements:
        statement.prepare(cursor)
        given = statement.values(params)
        texts.append(statement.execute_sql(given))
        values.extend(given)
    cursor.execute("; ".join(texts), values)


def _forget_prepared(sender, connection, **kwargs) -> None:
    connection.__dict__.pop("gpushare_prepared", None)


connection_created.connect(_forget_prepared)


def model_columns(model) -> list[str]:
    """The columns, in order, that :func:`model_from_row` reads a ``model`` instance from."""
    return [f.column for f in model._meta.concrete_fields]


def model_columns_sql(model, alias: str) -> str:
    """:func:`model_columns`, quoted and qualified by the table's ``alias``: a select list for ``model_from_row``."""
    return ", ".join(f"{alias}.{connection.ops.quote_name(name)}" for name in model_columns(model))


@functools.cache
def _model_converters(model, vendor: str) -> tuple:
    """(attnames, per field: its column and the converters the ORM applies to it on ``vendor``)."""
    fields = model._meta.concrete_fields
    converters = []
    for field in fields:
        column = field.get_col(model._meta.db_table)
        converters.append((column, (*connection.ops.get_db_converters(column), *field.get_db_converters(connection))))
    return [f.attname for f in fields], converters


def model_from_row(model, row):
    """A ``model`` instance from the first values of ``row``, one per :func:`model_columns`, with the
    converters the ORM applies (the backend's, then the field's own ``from_db_value``)."""
    attnames, converters = _model_converters(model, connection.vendor)
    values = []
    for (column, convert_all), value in zip(converters, row, strict=False):
        for convert in convert_all:
            value = convert(value, column, connection)
        values.append(value)
    return model.from_db(connection.alias, attnames, values)


def columns_sql(fields) -> str:
    """The quoted column list of a raw insert of ``fields``."""
    quote = connection.ops.quote_name
    return ", ".join(quote(f.column) for f in fields)


# Field classes whose ``get_db_prep_save`` hands a value of these exact types (or None) to the driver
# unchanged: such a value is used as it is. Everything else (a JSON or decimal column, a subclass with
# conversions of its own, an int given to a text column) is prepared by its field. A job's submit wrote 36
# columns through ``get_db_prep_save`` for ~0.2 ms of CPU, nearly all of it on values this rule passes.
_AS_IS: dict[type, tuple[type, ...]] = {
    models.CharField: (str,),
    models.TextField: (str,),
    models.IntegerField: (int,),
    models.PositiveIntegerField: (int,),
    models.BigIntegerField: (int,),
    models.ForeignKey: (int,),
}


def insert_values(instance, fields) -> list:
    """The values of a raw insert of ``instance``'s ``fields``, prepared by the fields as ``save()`` does
    (``pre_save``: ``auto_now_add``); a value already in the driver's form is not prepared again."""
    values = []
    for field in fields:
        value = field.pre_save(instance, True)
        if value is None or type(value) in _AS_IS.get(type(field), ()):
            values.append(value)
        else:
            values.append(field.get_db_prep_save(value, connection))
    return values


def inserted(instance, pk) -> None:
    """``instance`` as ``save()`` leaves a new row: its id, and no longer adding."""
    instance.pk = pk
    instance._state.adding, instance._state.db = False, connection.alias


def inserted_if(instance, pk) -> bool:
    """:func:`inserted`, for the id a conditional insert answered (None: its condition did not hold);
    whether it was written."""
    if pk is None:
        return False
    inserted(instance, pk)
    return True


@functools.cache
def _insert_sql(model, condition: str = "") -> tuple[list, str]:
    """The fields of a raw insert of a new ``model`` row and its statement (``%s`` for each field's value,
    then ``condition``'s), answering the new row's id."""
    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    quote = connection.ops.quote_name
    values = ", ".join(["%s"] * len(fields))
    rows = f"SELECT {values} WHERE {condition}" if condition else f"VALUES ({values})"
    return fields, (
        f"INSERT INTO {quote(model._meta.db_table)} ({columns_sql(fields)}) {rows} "
        f"RETURNING {quote(model._meta.pk.column)}"
    )


@functools.cache
def _insert_statement(model, condition: str = "") -> tuple[list, ServerStatement]:
    fields, sql = _insert_sql(model, condition)
    return fields, ServerStatement(sql)


def insert_parts(instance, *, condition: str = "", params: tuple = ()) -> tuple[str, tuple]:
    """:func:`model_insert`'s statement for ``instance`` and its values, for a caller that sends it inside
    a statement of its own (a WITH item); the id it answers goes to :func:`inserted`."""
    fields, sql = _insert_sql(type(instance), condition)
    return sql, (*insert_values(instance, fields), *params)


def model_insert(instance, *, condition: str = "", params: tuple = ()):
    """``instance.save(force_insert=True)`` for a new row with no signals nor parents to save, as one
    statement planned once per connection, its values prepared by the model's own fields as ``save()``
    does (``pre_save``: ``auto_now_add``): the ORM's insert cost ~0.3 ms of CPU to build. Elsewhere than
    on PostgreSQL (or with server-side statements off) ``save()`` itself.

    ``condition`` (SQL with ``params``, a constant string: the statement is kept per condition): the row
    is written only if it holds, and None answered when it does not (always written off PostgreSQL)."""
    if connection.vendor != "postgresql":
        instance.save(force_insert=True)
        return instance
    fields, statement = _insert_statement(type(instance), condition)
    with connection.cursor() as cursor:
        statement.execute(cursor, [*insert_values(instance, fields), *params])
        row = cursor.fetchone()
    return instance if inserted_if(instance, row[0] if row else None) else None
