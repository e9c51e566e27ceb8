"""Read queries for jobs."""

from __future__ import annotations

from django.db import connection
from django.db.models import QuerySet

from .models import Job, JobLogChunk, JobState


def jobs_for_tenant(*, tenant) -> QuerySet[Job]:
    return Job.objects.filter(tenant=tenant).select_related("node", "priority")


def job_gpu_uuids(job: Job) -> list[str]:
    """The GPUs the job holds now, or held last (for a finished job); uses the prefetched allocations."""
    return allocations_held_uuids([(a.released_at, a.gpu.index, a.gpu.uuid) for a in job.allocations.all()])


def allocations_held_uuids(allocations: list[tuple]) -> list[str]:
    """Of one job's allocations as ``(released_at, gpu index, gpu uuid)``, the GPUs it holds now, or held
    last, in index order.

    The allocations of one placement are inserted together but do not share a
    ``created_at`` to the microsecond, while a release stamps them all with one
    ``released_at``: so "held last" is the set released last.
    """
    held = [a for a in allocations if a[0] is None]
    if not held and allocations:
        last = max(a[0] for a in allocations)
        held = [a for a in allocations if a[0] == last]
    return [uuid for _, _, uuid in sorted(held, key=lambda a: a[1])]


def queue_position(job: Job) -> int | None:
    """1-based place among the queued jobs of the same or higher class (None unless queued)."""
    if job.state != JobState.QUEUED:
        return None
    from django_scopes import scopes_disabled

    with scopes_disabled():  # the place counts every tenant's queued jobs (only a number leaves)
        ahead = Job.objects.filter(state=JobState.QUEUED, priority__rank__gt=job.priority.rank).count()
        ahead += Job.objects.filter(
            state=JobState.QUEUED, priority__rank=job.priority.rank, submitted_at__lt=job.submitted_at
        ).count()
    return ahead + 1


def job_log_read(job: Job, *, offset: int, limit: int = 1 << 20) -> tuple[bytes, int]:
    """Bytes of the job's output from ``offset`` (at most ``limit``), and the next offset."""
    chunks = JobLogChunk.objects.filter(job=job, offset__gte=_chunk_start(job, offset)).order_by("offset")
    return _chunks_join(chunks.values_list("offset", "data").iterator(), offset=offset, limit=limit)


ROTATED_MARK = -1  # a chunk at this offset: the output before the first stored chunk was rotated off


def _chunks_join(chunks, *, offset: int, limit: int) -> tuple[bytes, int]:
    out = bytearray()
    next_offset = offset
    rotated = False
    for chunk_offset, data in chunks:
        data = bytes(data)
        if chunk_offset == ROTATED_MARK:
            rotated = True  # the log was kept to its limit (scheduler.services.job_logs_rotate)
            continue
        if rotated and not out and chunk_offset > next_offset:
            next_offset = chunk_offset  # that output was rotated off: go on from the oldest kept
        rotated = False
        if chunk_offset > next_offset:
            break  # a gap: wait for the missing chunk
        start = next_offset - chunk_offset
        if start >= len(data):
            continue
        piece = data[start : start + limit - len(out)]
        out += piece
        next_offset += len(piece)
        if len(out) >= limit:
            break
    return bytes(out), next_offset


def job_log_end(job: Job) -> int:
    """The byte offset just past the job's last stored log chunk (0: no output)."""
    from django.db.models.functions import Length

    last = JobLogChunk.objects.filter(job=job).order_by("-offset").values("offset", size=Length("data")).first()
    return last["offset"] + last["size"] if last else 0


def job_log_poll(*, tenant, job_id, offset: int, limit: int = 1 << 20) -> tuple[Job, bytes, int] | None:
    """``(job, bytes from offset, next offset)`` for the tenant's job, or None (no such job for this tenant).

    One statement on PostgreSQL: the job row (its state and end, for ``complete``) with the chunks
    that overlap ``[offset, offset + limit)``, by the ``(job, offset)`` unique index, so polling a log
    costs one indexed query whatever its length.
    """
    if not str(job_id).isascii() or not str(job_id).isdigit() or int(job_id) >= 2**63:
        return None
    if connection.vendor != "postgresql":
        job = jobs_for_tenant(tenant=tenant).filter(pk=int(job_id)).first()
        if job is None:
            return None
        return job, *job_log_read(job, offset=offset, limit=limit)
    jobs, chunks = Job._meta.db_table, JobLogChunk._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT j.id, j.state, j.finished_at, c."offset", c.data
            FROM {jobs} j LEFT JOIN LATERAL (
                SELECT c."offset", c.data FROM {chunks} c
                WHERE c.job_id = j.id
                  AND c."offset" >= COALESCE(
                      (SELECT max(b."offset") FROM {chunks} b WHERE b.job_id = j.id AND b."offset" <= %s), 0)
                  AND c."offset" < %s
                ORDER BY c."offset") c ON true
            WHERE j.id = %s AND j.tenant_id = %s
            ORDER BY c."offset"
            """,
            [offset, offset + limit, int(job_id), tenant.pk],
        )
        rows = cursor.fetchall()
    if not rows:
        return None
    job = Job(pk=rows[0][0], tenant_id=tenant.pk, state=rows[0][1], finished_at=rows[0][2])
    data, next_offset = _chunks_join(((r[3], r[4]) for r in rows if r[3] is not None), offset=offset, limit=limit)
    return job, data, next_offset


def _chunk_start(job: Job, offset: int) -> int:
    """Offset of the chunk that contains byte ``offset``."""
    chunk = JobLogChunk.objects.filter(job=job, offset__lte=offset).order_by("-offset").values("offset").first()
    return chunk["offset"] if chunk else 0


def tenant_weights() -> dict[int, object]:
    """Tenant id -> fair-share weight (Decimal), for tenants whose weight was set (others weigh 1)."""
    from django_scopes import scopes_disabled

    from .models import TenantShare

    with scopes_disabled():  # every tenant's weight, for the scheduling pass
        return dict(TenantShare.objects.values_list("tenant_id", "weight"))


def scheduler_settings():
    """The scheduler's settings in force (half-life, default max runtime, backfill)."""
    from .passes import settings_get

    return settings_get()


RECENT_JOBS = 500  # the latest submissions whose shapes make the placement core's workload mix


def recent_shapes(*, limit: int = RECENT_JOBS) -> list[tuple]:
    """(mode, gpu milli, gpu model, gpu memory) of the latest submitted jobs, any state or tenant: the
    recent mix of request shapes the placement core keeps free capacity for."""
    from django_scopes import scopes_disabled

    with scopes_disabled():  # every tenant's recent shapes, for the scheduling pass
        return list(Job.objects.order_by("-id").values_list("mode", "gpu_milli", "gpu_model", "gpu_memory_mb")[:limit])
