"""Read queries the REST layer needs in bulk (one query per page, not per job).

These belong with scheduler/selectors.py in spirit; they live here so the API
can page through jobs without an N+1 on ``queue_position`` or the metrics.
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import connection
from django.db.models import CharField, F, IntegerField, Max, Min, QuerySet, Sum
from django.db.models.expressions import RawSQL

from accounts.tenancy import tenant_id_of, tenant_scope
from agents.models import Gpu

from ..models import Allocation, Job, JobState, OpenJob, PriorityClass

MAX_METRIC_POINTS = 500


def _queue_position_sql() -> str:
    """SQL for a job row's queue position (1-based; NULL unless queued): the queued jobs of higher
    classes, plus those of the same rank submitted before it. On PostgreSQL both counts are range
    scans of the narrow table of unfinished jobs (``OpenJob``, kept by triggers; its queued rows by class,
    submission time and id), so the cost is the number of queued jobs ahead of it, never the size of
    the job table nor its history; elsewhere the same counts over the jobs."""
    job, classes = Job._meta.db_table, PriorityClass._meta.db_table
    rank = f"(SELECT r.rank FROM {classes} r WHERE r.id = {job}.priority_id)"
    if connection.vendor == "postgresql":
        queue = OpenJob._meta.db_table

        def ahead(op: str) -> str:
            # = ANY(ARRAY(...)) makes the class the index's leading key (a range per class).
            return f"""(SELECT count(*) FROM {queue} q WHERE q.state = 'queued'
                AND q.priority_id = ANY(ARRAY(SELECT c.id FROM {classes} c WHERE c.rank {op} {rank}))"""

        return f"""CASE WHEN {job}.state = 'queued' THEN 1 + {ahead(">")})
            + {ahead("=")} AND (q.submitted_at, q.job_id) < ({job}.submitted_at, {job}.id)) END"""
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


def with_api_fields(queryset: QuerySet[Job], *, queue_position: bool = True) -> QuerySet[Job]:
    """The jobs with what the API shows computed in the same query: ``api_queue_position`` (unless
    ``queue_position=False``: a list page asks :func:`queue_positions_ranked` once instead),
    ``api_gpu_uuids`` (so a page or a detail is one query, whatever the state of its jobs)."""
    if queue_position:
        queryset = queryset.annotate(api_queue_position=RawSQL(_queue_position_sql(), [], output_field=IntegerField()))
    if connection.vendor != "postgresql":  # the SQLite demo: no arrays, the allocations are prefetched
        return queryset.prefetch_related("allocations__gpu")
    return queryset.annotate(api_gpu_uuids=RawSQL(_gpu_uuids_sql(), [], output_field=ArrayField(CharField())))


def queue_positions_ranked(*, tenant, job_ids: list[int]) -> dict[int, int]:
    """Queue positions of many queued jobs of ``tenant`` at once (a list page): one ranking of the whole
    queue (every tenant's jobs count for the place), O(queue), where a position per job costs O(jobs
    ahead) each. Jobs that are not queued, or not the tenant's, are absent."""
    if not job_ids:
        return {}
    job, classes = Job._meta.db_table, PriorityClass._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""SELECT id, position FROM (
                    SELECT j.id, j.tenant_id, row_number() OVER (ORDER BY c.rank DESC, j.submitted_at, j.id) AS position
                    FROM {job} j JOIN {classes} c ON c.id = j.priority_id WHERE j.state = 'queued') ranked
                WHERE tenant_id = %s AND id IN ({", ".join(["%s"] * len(job_ids))})""",
            [tenant_id_of(tenant), *job_ids],
        )
        return dict(cursor.fetchall())


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
