"""Read queries the REST layer needs in bulk (one query per page, not per job).

These belong with scheduler/selectors.py in spirit; they live here so the API
can page through jobs without an N+1 on ``queue_position`` or the metrics.
"""

from __future__ import annotations

import functools

from django.contrib.postgres.fields import ArrayField
from django.db import connection
from django.db.models import CharField, F, IntegerField, Max, Min, QuerySet, Sum
from django.db.models.expressions import RawSQL

from accounts.tenancy import tenant_id_of, tenant_scope
from agents.models import Gpu
from gpushare.prepared import ServerStatement

from ..counts import queued_in_sql
from ..models import Allocation, Job, JobState, OpenJob, PriorityClass
from ..selectors import allocations_held_uuids

MAX_METRIC_POINTS = 500
# A queued job's place is counted from the queue's end when at most this many queued jobs of its rank are at
# or after it (a recent job, which a job list shows first), else from the queue's head.
TAIL_COUNTED = 10_000


def _of_rank(op: str, rank: str) -> str:
    """The ids of the classes whose rank is ``op`` ``rank`` (SQL), as an array: ``= ANY(...)`` of it makes the
    class the leading key of ``OpenJob``'s queued index (a range per class)."""
    return f"ARRAY(SELECT c.id FROM {PriorityClass._meta.db_table} c WHERE c.rank {op} {rank})"


def _ahead_sql(rank: str, at: str, tail: str) -> str:
    """An expression: the queued jobs ahead of the place ``at`` (the SQL of a ``(submitted_at, id)`` pair) of a
    job of rank ``rank``: the classes ranked above (kept counts), plus its rank's kept count less the queued
    jobs of its rank at or after ``at`` when there are at most ``tail`` (the SQL of a number), else those before
    ``at`` counted from the queue's head."""

    def same_rank(op: str, limit: str = "") -> str:
        return f"""(SELECT count(*) FROM (SELECT 1 FROM {OpenJob._meta.db_table} a WHERE a.state = 'queued'
                      AND a.priority_id = ANY({_of_rank("=", rank)}) AND (a.submitted_at, a.job_id) {op} {at}
                      {limit}) n)"""

    return f"""({queued_in_sql(_of_rank(">", rank))} + (
        SELECT CASE WHEN t.n <= {tail} THEN {queued_in_sql(_of_rank("=", rank))} - t.n ELSE {same_rank("<")} END
          FROM (SELECT {same_rank(">=", f"LIMIT {tail} + 1")} AS n) t))"""


def _queue_position_sql() -> str:
    """SQL for a job row's queue position (1-based; NULL unless queued): the queued jobs of higher
    classes, plus those of the same rank submitted before it. On PostgreSQL the first are the counts the
    database keeps (``scheduler.counts``) and the second its rank's kept count less the queued jobs of its
    rank from it to the queue's end, counted on the narrow table of unfinished jobs (``OpenJob``, kept by
    triggers; its queued rows by class, submission time and id) when there are at most ``TAIL_COUNTED``
    (a recent job), else those before it counted from the queue's head: the cost is the smaller side of
    the queue, at most ``TAIL_COUNTED``, never the size of the job table nor its history; elsewhere the
    same counts over the jobs."""
    job, classes = Job._meta.db_table, PriorityClass._meta.db_table
    rank = f"(SELECT r.rank FROM {classes} r WHERE r.id = {job}.priority_id)"
    if connection.vendor == "postgresql":
        ahead = _ahead_sql(rank, f"({job}.submitted_at, {job}.id)", str(TAIL_COUNTED))
        return f"CASE WHEN {job}.state = 'queued' THEN 1 + {ahead} END"
    ids = f"SELECT c.id FROM {classes} c WHERE c.rank"
    return f"""CASE WHEN {job}.state = 'queued' THEN 1
        + (SELECT count(*) FROM {job} a WHERE a.state = 'queued' AND a.priority_id IN ({ids} > {rank}))
        + (SELECT count(*) FROM {job} a WHERE a.state = 'queued' AND a.priority_id IN ({ids} = {rank})
             AND (a.submitted_at, a.id) < ({job}.submitted_at, {job}.id))
        END"""


def _gpu_uuids_sql() -> str:
    """SQL for the GPUs a job row holds now, or held last (the set released last), in index order."""
    job, allocations, gpus = Job._meta.db_table, Allocation._meta.db_table, Gpu._meta.db_table
    return f"""ARRAY(SELECT g.uuid FROM {allocations} a JOIN {gpus} g ON g.id = a.gpu_id
        WHERE a.job_id = {job}.id AND a.released_at IS NOT DISTINCT FROM (
            SELECT CASE WHEN bool_or(b.released_at IS NULL) THEN NULL ELSE max(b.released_at) END
            FROM {allocations} b WHERE b.job_id = {job}.id)
        ORDER BY g.index)"""


# The columns (``.values()`` names) a job's API body is built from (scheduler.api.serializers.job_body): a page
# reads only these, never the jobs' environments (tenant secrets) nor the nodes' columns.
JOB_API_COLUMNS = (
    *("id", "array_id", "array_index", "name", "kind", "gpu_milli", "mode", "state", "pending_reason"),
    *("estimated_start_at", "priority__name", "node__name", "isolation", "command", "image", "gpu_model"),
    *("gpu_memory_mb", "max_runtime_s", "submitted_at", "started_at", "finished_at", "exit_code", "stop_reason"),
    *("preemption_count", "cost", "gpu_ms", "sm_util_ms", "memory_peak_mb", "energy_mj"),
    "submitted_by_id",  # not shown: the owner, for the object permissions of a detail
)


def with_api_fields(queryset: QuerySet[Job], *, queue_position: bool = True) -> QuerySet[Job]:
    """The jobs with what the API shows computed in the same query: ``api_queue_position`` (unless
    ``queue_position=False``), ``api_gpu_uuids`` (so a detail is one query, whatever the state of the job)."""
    if queue_position:
        queryset = queryset.annotate(api_queue_position=RawSQL(_queue_position_sql(), [], output_field=IntegerField()))
    if connection.vendor != "postgresql":  # the SQLite demo: no arrays, the allocations are prefetched
        return queryset.prefetch_related("allocations__gpu")
    return queryset.annotate(api_gpu_uuids=RawSQL(_gpu_uuids_sql(), [], output_field=ArrayField(CharField())))


def job_api_rows(queryset: QuerySet[Job], *, computed: bool) -> QuerySet[dict]:
    """The jobs as plain rows (``.values()``: no model instances) of :data:`JOB_API_COLUMNS`.

    ``computed=True`` (a detail: one query): ``queue_position`` and, on PostgreSQL, ``gpu_uuids`` are computed in
    the same query. A list page leaves them out (their per-row subqueries cost more to plan than the page costs
    to read) and :func:`job_api_rows_complete` fills them in for the whole page at once."""
    if not computed:
        return queryset.values(*JOB_API_COLUMNS)
    extra = {"queue_position": RawSQL(_queue_position_sql(), [], output_field=IntegerField())}
    if connection.vendor == "postgresql":
        extra["gpu_uuids"] = RawSQL(_gpu_uuids_sql(), [], output_field=ArrayField(CharField()))
    return queryset.values(*JOB_API_COLUMNS, **extra)


def job_api_rows_complete(rows: list[dict], *, tenant) -> list[dict]:
    """``rows`` of :func:`job_api_rows` of ``tenant``, each with ``gpu_uuids`` and ``queue_position``: what the
    query left out is read for all the rows at once (the GPUs in one query, the queued rows' positions in one
    more), so a page costs the same few queries however many jobs it shows."""
    if rows and "gpu_uuids" not in rows[0]:
        held = gpu_uuids_of(tenant=tenant, job_ids=[row["id"] for row in rows])
        for row in rows:
            row["gpu_uuids"] = held.get(row["id"], [])
    if rows and "queue_position" not in rows[0]:
        positions = queue_positions_page(
            tenant=tenant, job_ids=[row["id"] for row in rows if row["state"] == JobState.QUEUED]
        )
        for row in rows:
            row["queue_position"] = positions.get(row["id"])
    return rows


def gpu_uuids_of(*, tenant, job_ids: list[int]) -> dict[int, list[str]]:
    """The GPUs each of ``tenant``'s jobs holds now, or held last (:func:`allocations_held_uuids`), in one
    indexed query for any number of jobs. Jobs that never held one are absent."""
    if not job_ids:
        return {}
    allocations, gpus = Allocation._meta.db_table, Gpu._meta.db_table
    index = connection.ops.quote_name("index")  # a keyword of SQLite's (the demo)
    select = f"""SELECT a.job_id, a.tenant_id, a.released_at, g.{index}, g.uuid
                   FROM {allocations} a JOIN {gpus} g ON g.id = a.gpu_id WHERE a.job_id"""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # one statement for any page, planned once per connection
            _allocations_statement(select).execute(cursor, [list(job_ids)])
        else:
            cursor.execute(f"{select} IN ({', '.join(['%s'] * len(job_ids))})", job_ids)
        # The tenant is checked here, not in the WHERE: PostgreSQL would read its whole history's allocations
        # from the tenant_id index to intersect them with the page's few.
        tenant_id = tenant_id_of(tenant)
        by_job: dict[int, list[tuple]] = {}
        for job_id, owner_id, *held in cursor.fetchall():
            if owner_id == tenant_id:
                by_job.setdefault(job_id, []).append(held)
    return {job_id: allocations_held_uuids(held) for job_id, held in by_job.items()}


@functools.cache
def _allocations_statement(select: str) -> ServerStatement:
    return ServerStatement(f"{select} = ANY(%s)")


def queue_positions_page(*, tenant, job_ids: list[int]) -> dict[int, int]:
    """Queue positions of a page's queued jobs of ``tenant`` (every tenant's queued jobs count for the place;
    higher class first, then first come), in one query whose cost does not grow with the queue.

    Per class rank among the page's jobs: the queued jobs ahead of its first job are those of the classes
    ranked above (the counts the database keeps, ``scheduler.counts``) plus those of its rank before it: its
    rank's kept count less the jobs from the page's first to the queue's end, counted on the narrow table of
    unfinished jobs (``OpenJob``: queued rows by class, submission time and id) when there are at most
    ``TAIL_COUNTED`` (a page of recent jobs), else counted from the queue's head (a page of old ones). The
    jobs from its first to its last are read in order from the same index (the page's own span of the queue).
    Jobs that are not queued, or not the tenant's, are absent."""
    if not job_ids:
        return {}
    if connection.vendor != "postgresql":  # the SQLite demo: a count per job
        return queue_positions(tenant=tenant, job_ids=job_ids)
    with connection.cursor() as cursor:
        _positions_statement().execute(
            cursor, {"tenant": tenant_id_of(tenant), "ids": list(job_ids), "tail": TAIL_COUNTED}
        )
        return dict(cursor.fetchall())


def _positions_sql(page: str, tail: str) -> str:
    """CTEs ending in ``positions (id, position)``: the queue places of the queued jobs that ``page`` (a
    SELECT of ``id, submitted_at, rank``) lists, as :func:`queue_positions_page` describes them; ``tail``:
    the SQL of ``TAIL_COUNTED``."""
    queue = OpenJob._meta.db_table
    first = "(s.first_at, s.first_id)"
    return f"""page_queued AS ({page}), spans AS (
            SELECT rank, (array_agg(submitted_at ORDER BY submitted_at, id))[1] AS first_at,
                (array_agg(id ORDER BY submitted_at, id))[1] AS first_id,
                (array_agg(submitted_at ORDER BY submitted_at DESC, id DESC))[1] AS last_at,
                (array_agg(id ORDER BY submitted_at DESC, id DESC))[1] AS last_id
            FROM page_queued GROUP BY rank
        ), ahead AS MATERIALIZED (  -- the counts once per rank, not once per job
            SELECT s.*, {_ahead_sql("s.rank", first, tail)} AS before FROM spans s
        ), positions AS (
            SELECT q.id, q.position FROM (
                SELECT a.job_id AS id,
                    s.before + row_number() OVER (PARTITION BY s.rank ORDER BY a.submitted_at, a.job_id) AS position
                FROM ahead s JOIN {queue} a ON a.state = 'queued' AND a.priority_id = ANY({_of_rank("=", "s.rank")})
                    AND (a.submitted_at, a.job_id) >= {first}
                    AND (a.submitted_at, a.job_id) <= (s.last_at, s.last_id)
            ) q JOIN page_queued p ON p.id = q.id
        )"""


@functools.cache
def _positions_statement() -> ServerStatement:
    job, classes = Job._meta.db_table, PriorityClass._meta.db_table
    page = f"""SELECT j.id, j.submitted_at, c.rank FROM {job} j JOIN {classes} c ON c.id = j.priority_id
        WHERE j.tenant_id = %(tenant)s AND j.state = 'queued' AND j.id = ANY(%(ids)s)"""
    return ServerStatement(f"WITH {_positions_sql(page, '%(tail)s')} SELECT id, position FROM positions")


def queue_positions(*, tenant, job_ids: list[int]) -> dict[int, int]:
    """1-based place of each queued job of ``tenant`` (a tenant or its id) among all queued jobs of
    every tenant (higher class first, then first come).

    Jobs that are not queued, or not the tenant's, are absent from the answer. One query for any number of jobs.
    """
    if not job_ids:
        return {}
    with tenant_scope(tenant):
        rows = (
            Job.objects.filter(pk__in=job_ids, state=JobState.QUEUED)
            .annotate(position=RawSQL(_queue_position_sql(), [], output_field=IntegerField()))
            .values_list("pk", "position")
        )
        return dict(rows)


def job_metric_series(*, job: Job, max_points: int = MAX_METRIC_POINTS) -> dict:
    """The job's metering windows as a chart series, merged into at most ``max_points`` buckets.

    Each point: start/end (ms), SM utilisation % (averaged over the job's GPUs),
    average and peak GPU memory (MB) and mean power (W = mJ / ms). Two queries.
    """
    windows = job.usage_windows.all()  # billing's windows, by the reverse relation (billing is above us)
    span = windows.aggregate(first=Min("start_ms"), last=Max("end_ms"))
    if span["first"] is None:
        return {"bucket_ms": 0, "points": []}
    first, last = span["first"], span["last"]
    bucket_ms = max(1, -(-(last - first) // max_points))
    rows = (
        windows.annotate(bucket=(F("start_ms") - first) / bucket_ms)
        .values("bucket")
        .annotate(
            bucket_start=Min("start_ms"),
            bucket_end=Max("end_ms"),
            wall_ms=Sum(F("end_ms") - F("start_ms")),
            sm_util_ms=Sum("sm_util_ms"),
            memory_ms=Sum(F("memory_avg_mb") * (F("end_ms") - F("start_ms"))),
            memory_peak_mb=Max("memory_peak_mb"),
            energy_mj=Sum("energy_mj"),
            gpu_ms=Sum("gpu_ms"),
        )
        .order_by("bucket")
    )
    gpus = job.gpu_count
    points = []
    for row in rows:
        wall = row["wall_ms"] or 1
        points.append(
            {
                "start_ms": row["bucket_start"],
                "end_ms": row["bucket_end"],
                "sm_util_pct": round(row["sm_util_ms"] / (wall * gpus) * 100, 1),
                "memory_avg_mb": round(row["memory_ms"] / wall),
                "memory_peak_mb": row["memory_peak_mb"],
                "power_w": round(row["energy_mj"] / wall, 1),
                "gpu_seconds": round(row["gpu_ms"] / 1000, 3),
            }
        )
    return {"bucket_ms": bucket_ms, "points": points}
