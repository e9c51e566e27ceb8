"""A job list page written as JSON by PostgreSQL, and kept in the web process while nothing on it changes.

Pollers (CI fleets, dashboards, the CLI's ``--watch``) ask for the same first page again and again, and
most of the time nothing on it has changed. Writing the page (:func:`job_page_statement`) costs ~0.8 ms of
PostgreSQL's CPU for 50 jobs; reading what it is written from (:func:`job_page_versions_statement`) ~0.15 ms.
So a page is kept, per process, with the **versions** of what it was written from, and served again only
while a fresh read of the versions is equal to them.

Why a kept page is never stale:

- The versions are a digest of the page's rows' ids and versions (``xmin``: every committed change of a row
  writes a new version of it stamped with the writing transaction's id, and a row never gets an earlier
  version back) and of one more row's version, the shown names'. The row past the page's end (``size + 1``)
  is included: it decides the ``next`` link. Jobs added, removed, changed or moved in or out of the page's
  window all change the digest.
- What a page shows from other tables is made to change those versions by the database itself, whoever
  writes (PostgreSQL triggers, ``scheduler/migrations/0009``): an allocation written (the job's GPUs) gives
  its job a new version, unless the same transaction wrote the job already; a class's or node's name, or a
  GPU's uuid or index, changed (or such a row deleted) writes the one row of
  :class:`~scheduler.models.ShownNamesVersion`. So the check reads no allocation, class, node or GPU: it
  cost ~440 us of PostgreSQL's CPU when it read them all, ~150 us now; and a node's heartbeat, which writes
  the node's row but not its name, leaves kept pages kept.
- A kept page's versions are read in the page's own statement (one snapshot), so page and versions always
  describe the same moment.
- A page that shows a queued job is never kept: its place in the queue changes with other tenants' jobs.
- Inside a transaction (``connection.in_atomic_block``) nothing is read from or written to the cache: a
  transaction's own uncommitted writes carry its id, which two writes of the same row in it share.
- Entries are keyed by tenant (and page), bounded in bytes (``GPUSHARE["LIST_CACHE_BYTES"]``, least recently
  used out first) and die with the process.

``tests/api/test_page_cache.py`` changes every input of a page in turn and holds the served page equal to a
freshly written one after each.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from django.conf import settings
from django.db import connection

from accounts.tenancy import tenant_id_of
from agents.models import Gpu, Node
from gpushare.caches import LockedLRU
from gpushare.flights import FreshFlights
from gpushare.prepared import ServerStatement

from ..models import MILLI_PER_GPU, Allocation, Job, JobState, PriorityClass, ShownNamesVersion
from .selectors import JOB_API_COLUMNS, TAIL_COUNTED, _positions_sql


def _iso_sql(column: str) -> str:
    """SQL for a timestamp as the API writes one (``serializers._iso``): UTC, ISO 8601 with ``Z``, the
    microseconds only when there are any (as Python's ``isoformat``). One ``to_char`` (two, and a
    ``date_trunc``, cost 90 us more per page of 50)."""
    return f"""(replace(to_char(({column} AT TIME ZONE 'UTC'), 'YYYY-MM-DD"T"HH24:MI:SS.US'), '.000000', '') || 'Z')"""


# The job's own columns of what the API shows (JOB_API_COLUMNS), the class and node by their ids.
_PAGE_COLUMNS = (*(c for c in JOB_API_COLUMNS if "__" not in c and c != "submitted_by_id"), "priority_id", "node_id")


def _window_sql(*, after: bool, older: bool, size: int, columns: str) -> str:
    """The ``j`` CTE of a page: ``columns`` of the tenant's jobs in the page's window (``size`` + 1 rows, to know
    whether there are more), each with its ``row_version``. ``after``: a keyset page after
    ``(%(at)s, %(job_id)s)``, older (``older``) or newer; else the newest. The size is in the text, not a
    parameter: with ``LIMIT $n`` PostgreSQL prices the generic plan as if it read the tenant's whole history
    and plans the statement again at every call."""
    keyset = f"AND (j.submitted_at, j.id) {'<' if older else '>'} (%(at)s, %(job_id)s)" if after else ""
    order = _order(after=after, older=older)
    return f"""j AS MATERIALIZED (
        SELECT {columns}, j.xmin AS row_version FROM {Job._meta.db_table} j WHERE j.tenant_id = %(tenant)s {keyset}
        ORDER BY j.submitted_at {order}, j.id {order} LIMIT {int(size) + 1})"""


def _order(*, after: bool, older: bool) -> str:
    """Newest first, but for a page of newer jobs (read upwards from the cursor, then reversed)."""
    return "DESC" if older or not after else "ASC"


def _versions_cte() -> str:
    """The CTE after a page's ``j``, ``versions (versions)``: one row, the digest (``bytea``) of everything the
    page is written from, as the module's docstring lists it: its rows' ids and versions (integers, so the
    text is unambiguous) and the shown names' version. It reads no allocation, class, node or GPU: the
    database's triggers make their changes reach these versions."""
    shown_names = ShownNamesVersion._meta.db_table
    return f"""versions AS MATERIALIZED (SELECT sha256(convert_to(
            coalesce((SELECT string_agg(j.id || ' ' || j.row_version, ',' ORDER BY j.submitted_at, j.id) FROM j), '')
            || '|' || coalesce((SELECT v.xmin::text FROM {shown_names} v WHERE v.id = 1), ''),
        'UTF8')) AS versions)"""


@functools.cache
def job_page_statement(*, after: bool, older: bool, size: int) -> ServerStatement:
    """A page of a tenant's jobs written as JSON by PostgreSQL: each row's ``(id, submitted_at, state, body,
    versions)``, ``body`` the text of the job's API object, key for key and figure for figure what
    :func:`scheduler.api.serializers.job_body` writes (``tests/api/test_job_page_json.py`` holds the two
    equal), queued jobs' places included (:func:`_positions_sql`, as :func:`queue_positions_page`);
    ``versions`` the digest of what the page was written from (:func:`_versions_cte`, the same on every row).
    A list page's jobs are never decoded into Python values nor encoded again: that per-row work was most of
    a page's CPU.

    Newest first, ``size`` + 1 rows; newer pages (``after`` and not ``older``) come oldest first (the caller
    reverses them, as :meth:`KeysetPagination.paginate_rows`). The page's GPUs are read in one pass over its
    allocations (a subquery per job cost twice as much)."""
    classes, nodes = PriorityClass._meta.db_table, Node._meta.db_table
    allocations, gpus = Allocation._meta.db_table, Gpu._meta.db_table
    order = _order(after=after, older=older)
    whole = f"(j.gpu_milli / {MILLI_PER_GPU})"
    held = f"(j.gpu_ms * {MILLI_PER_GPU} / j.gpu_milli)"  # integer division, as job_body's //
    gpu_held = f"({held} * greatest(1, {whole}))::numeric"
    # What the page shows, by column: never the environment (tenant secrets), read or not.
    page_columns = ", ".join(f"j.{c}" for c in _PAGE_COLUMNS)
    queued = (
        f"SELECT j.id, j.submitted_at, r.rank FROM j JOIN {classes} r ON r.id = j.priority_id WHERE j.state = 'queued'"
    )
    return ServerStatement(
        f"""WITH {_window_sql(after=after, older=older, size=size, columns=page_columns)},
            held AS (  -- what each holds now, or held last (the set released last), in index order
                SELECT a.job_id, array_agg(g.uuid ORDER BY g.index) AS uuids FROM (
                    SELECT a.job_id, a.gpu_id, a.released_at,
                        bool_or(a.released_at IS NULL) OVER (PARTITION BY a.job_id) AS holding,
                        max(a.released_at) OVER (PARTITION BY a.job_id) AS last
                    FROM {allocations} a WHERE a.job_id = ANY(ARRAY(SELECT id FROM j))
                ) a JOIN {gpus} g ON g.id = a.gpu_id
                WHERE CASE WHEN a.holding THEN a.released_at IS NULL ELSE a.released_at = a.last END
                GROUP BY a.job_id
            ), {_positions_sql(queued, "%(tail)s")}, {_versions_cte()}
            SELECT j.id, j.submitted_at, j.state, row_to_json(b)::text, v.versions FROM j
              JOIN {classes} c ON c.id = j.priority_id
              LEFT JOIN {nodes} n ON n.id = j.node_id
              LEFT JOIN held h ON h.job_id = j.id
              LEFT JOIN positions p ON p.id = j.id
              CROSS JOIN versions v
              CROSS JOIN LATERAL (SELECT
                j.id AS id,
                (SELECT row_to_json(a) FROM (SELECT j.array_id AS id, j.array_index AS "index") a
                  WHERE j.array_id IS NOT NULL) AS "array",
                j.name AS name, j.kind AS kind,
                CASE WHEN j.gpu_milli %% {MILLI_PER_GPU} = 0 THEN to_json({whole})
                     ELSE to_json(j.gpu_milli::float8 / {MILLI_PER_GPU}) END AS gpus,
                j.mode AS mode, j.state AS state, j.pending_reason AS pending_reason,
                p.position AS queue_position,
                {_iso_sql("j.estimated_start_at")} AS estimated_start,
                c.name AS priority, n.name AS node,
                coalesce(h.uuids, '{{}}') AS gpu_uuids,
                NULLIF(j.isolation, '') AS isolation,
                j.command AS command, j.image AS image, j.gpu_model AS gpu_model,
                j.gpu_memory_mb AS gpu_memory_mb, j.max_runtime_s AS max_runtime_seconds,
                {_iso_sql("j.submitted_at")} AS submitted_at, {_iso_sql("j.started_at")} AS started_at,
                {_iso_sql("j.finished_at")} AS finished_at,
                j.exit_code AS exit_code, j.stop_reason AS stop_reason, j.preemption_count AS preemption_count,
                j.cost::text AS cost,
                (SELECT row_to_json(u) FROM (SELECT
                    j.gpu_ms::float8 / 1000 AS gpu_seconds,
                    CASE WHEN {held} > 0 THEN
                      floor((2000 * j.sm_util_ms::numeric + {gpu_held}) / (2 * {gpu_held}))::float8 / 10
                    END AS sm_util_avg,
                    j.memory_peak_mb AS memory_peak_mb,
                    floor((2 * j.energy_mj::numeric + 360) / 720)::float8 / 10000 AS energy_wh) u) AS usage
              ) b
            ORDER BY j.submitted_at {order}, j.id {order}"""
    )


@functools.cache
def job_page_versions_statement(*, after: bool, older: bool, size: int) -> ServerStatement:
    """The digest :func:`job_page_statement` writes beside the same page (one row, one column): an index range
    scan of the page's window and one row read by its key; nothing is written out."""
    columns = "j.id, j.submitted_at"
    window = _window_sql(after=after, older=older, size=size, columns=columns)
    return ServerStatement(f"WITH {window}, {_versions_cte()} SELECT versions FROM versions")


class JobPage(NamedTuple):
    rows: list[dict]  # {"id", "submitted_at", "state", "json"}: size + 1 at most, in the statement's order
    versions: bytes | None  # what the rows were written from (None: no rows)


def _values(*, tenant, key) -> dict:
    values = {"tenant": tenant_id_of(tenant), "tail": TAIL_COUNTED}
    if key is not None:
        values["at"], values["job_id"] = key
    return values


def job_page_json(*, tenant, direction: str, key, size: int) -> JobPage:
    """A page of ``tenant``'s jobs written by :func:`job_page_statement`, the JSON as text. PostgreSQL only."""
    with connection.cursor() as cursor:
        statement = job_page_statement(after=key is not None, older=direction == "n", size=size)
        statement.execute(cursor, _values(tenant=tenant, key=key))
        found = cursor.fetchall()
    rows = [{"id": pk, "submitted_at": at, "state": state, "json": body} for pk, at, state, body, _ in found]
    return JobPage(rows, bytes(found[0][4]) if found else None)


def job_page_versions(*, tenant, direction: str, key, size: int) -> bytes:
    """The digest of what the page of ``tenant``'s jobs is written from now (:func:`_versions_cte`)."""
    with connection.cursor() as cursor:
        statement = job_page_versions_statement(after=key is not None, older=direction == "n", size=size)
        statement.execute(cursor, _values(tenant=tenant, key=key))
        (versions,) = cursor.fetchone()
    return bytes(versions)


class _Kept(NamedTuple):
    versions: bytes | None
    rows: list[dict] | None  # None: not kept (it showed a queued job, or nothing, when last written)


def _size_of(kept: _Kept) -> int:
    return 200 + sum(len(row["json"]) + 150 for row in kept.rows or ())


class PageCache(LockedLRU):
    """The pages this process keeps (thread-safe; least recently used out first past ``max_bytes``)."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, getsizeof=_size_of)


pages = PageCache(settings.GPUSHARE["LIST_CACHE_BYTES"])
page_reads: FreshFlights[list[dict]] = FreshFlights()  # the reads of a page that requests share


def job_page_rows(*, tenant, direction: str, key, size: int) -> list[dict]:
    """The rows of a page of ``tenant``'s jobs (:func:`job_page_json`'s), as read after this call began: from
    this process's kept page when the versions read now are the kept page's, else written afresh (and kept,
    unless it shows a queued job). Requests for the same page at the same time share one such read
    (:class:`~gpushare.flights.FreshFlights`). The rows are shared: callers must not change them.
    PostgreSQL only."""
    if connection.in_atomic_block:
        return job_page_json(tenant=tenant, direction=direction, key=key, size=size).rows
    page = (tenant_id_of(tenant), direction, key, size)
    return page_reads.run(page, lambda: _page_read(page))


def _page_read(page: tuple) -> list[dict]:
    """The rows of ``page`` (``(tenant id, direction, key, size)``, also its key in the kept pages), read now."""
    tenant, direction, key, size = page
    if not settings.GPUSHARE["LIST_CACHE_BYTES"]:
        return job_page_json(tenant=tenant, direction=direction, key=key, size=size).rows
    kept = pages.get(page)
    if kept is not None and kept.rows is not None:
        if job_page_versions(tenant=tenant, direction=direction, key=key, size=size) == kept.versions:
            return kept.rows
    written = job_page_json(tenant=tenant, direction=direction, key=key, size=size)
    keep = written.rows and not any(row["state"] == JobState.QUEUED for row in written.rows)
    pages.put(page, _Kept(written.versions, written.rows if keep else None))
    return written.rows
