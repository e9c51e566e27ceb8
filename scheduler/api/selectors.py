"""Read queries the REST layer needs in bulk (one query per page, not per job).

These belong with scheduler/selectors.py in spirit; they live here so the API
can page through jobs without an N+1 on ``queue_position`` or the metrics.
"""

from __future__ import annotations

from django.db.models import Count, F, IntegerField, Max, Min, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce
from django_scopes import scopes_disabled

from billing.models import UsageWindow

from ..models import Job, JobState

MAX_METRIC_POINTS = 500


def queue_positions(*, job_ids: list[int]) -> dict[int, int]:
    """1-based place of each queued job among all queued jobs (higher class first, then first come).

    Jobs that are not queued are absent from the answer. One query for a whole page.
    """
    if not job_ids:
        return {}
    rank, submitted, pk = OuterRef("priority__rank"), OuterRef("submitted_at"), OuterRef("pk")
    with scopes_disabled():
        ahead = (
            Job.objects.filter(state=JobState.QUEUED)
            .filter(
                Q(priority__rank__gt=rank)
                | Q(priority__rank=rank, submitted_at__lt=submitted)
                | Q(priority__rank=rank, submitted_at=submitted, pk__lt=pk)
            )
            .order_by()
            .values("state")
            .annotate(n=Count("pk"))
            .values("n")
        )
        rows = (
            Job.objects.filter(pk__in=job_ids, state=JobState.QUEUED)
            .annotate(ahead=Coalesce(Subquery(ahead, output_field=IntegerField()), 0))
            .values_list("pk", "ahead")
        )
        return {job_id: n + 1 for job_id, n in rows}


def job_metric_series(*, job: Job, max_points: int = MAX_METRIC_POINTS) -> dict:
    """The job's metering windows as a chart series, merged into at most ``max_points`` buckets.

    Each point: start/end (ms), SM utilisation % (averaged over the job's GPUs),
    average and peak GPU memory (MB) and mean power (W = mJ / ms). Two queries.
    """
    windows = UsageWindow.objects.filter(job=job)
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
