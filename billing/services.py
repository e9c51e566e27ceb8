"""Metering ingest and rating. Each service is one transaction."""

from __future__ import annotations

import logging
from decimal import Decimal

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django_scopes import scopes_disabled

from agents.models import Node
from scheduler.models import Allocation, Job

from .models import Price, UsageWindow
from .rating import allocated_gpu_ms, window_amount
from .selectors import price_at

log = logging.getLogger(__name__)

# A window longer than this is not something an agent sends: reject it.
MAX_WINDOW_MS = 15 * 60 * 1000


class WindowRejected(ValueError):
    pass


def _int(window: dict, key: str, default: int | None = None) -> int:
    value = window.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WindowRejected(f"{key} must be an integer, got {value!r}")
    if value < 0:
        raise WindowRejected(f"{key} must not be negative")
    return value


@scopes_disabled()
@transaction.atomic
def usage_windows_ingest(*, node: Node, windows: list[dict]) -> dict:
    """Store and rate metering windows exactly once.

    A window is identified by (job, node, seq): a replay is ignored. A window
    for an unknown job, a job never placed on ``node``, with impossible values
    or overlapping another window of the job is rejected and logged.
    """
    job_ids = {w.get("job_id") for w in windows if isinstance(w.get("job_id"), int)}
    # Lock the jobs (in id order, so concurrent batches cannot deadlock): the
    # replay and overlap checks below then see every window already stored.
    locked = Job.objects.select_for_update(of=("self",)).filter(pk__in=job_ids).order_by("pk")
    jobs = {job.pk: job for job in locked.select_related("priority")}
    models_on_node = dict(
        Allocation.objects.filter(job_id__in=job_ids, gpu__node=node).values_list("job_id", "gpu__model")
    )
    # Only stored windows that end after the batch's earliest start can be
    # replays of, or overlap, a window in this batch.
    earliest = min((w["start_ms"] for w in windows if isinstance(w.get("start_ms"), int)), default=0)
    existing: dict[int, list[tuple[int, int, int, int]]] = {}
    near = UsageWindow.objects.filter(job_id__in=job_ids, end_ms__gt=earliest)
    for job_id, attempt, seq, start, end in near.values_list(
        "job_id", "attempt", "seq", "start_ms", "end_ms"
    ):
        existing.setdefault(job_id, []).append((attempt, seq, start, end))

    rows: list[UsageWindow] = []
    rejected = 0
    prices: dict[tuple[str, str, int], Price | None] = {}
    for window in windows:
        try:
            row = _window_row(node, window, jobs, models_on_node, existing, prices)
        except WindowRejected as exc:
            rejected += 1
            log.warning("usage window from %s rejected: %s (%r)", node.name, exc, window)
            continue
        if row is not None:
            rows.append(row)
    UsageWindow.objects.bulk_create(rows)
    _job_totals_add(rows)
    return {"stored": len(rows), "rejected": rejected}


def _window_row(node, window, jobs, models_on_node, existing, prices) -> UsageWindow | None:
    job_id = _int(window, "job_id")
    job = jobs.get(job_id)
    if job is None:
        raise WindowRejected(f"unknown job {job_id}")
    if job_id not in models_on_node:
        raise WindowRejected(f"job {job_id} was never placed on node {node.name}")
    seq = _int(window, "seq")
    attempt = _int(window, "attempt", 1)
    start_ms, end_ms = _int(window, "start_ms"), _int(window, "end_ms")
    if end_ms <= start_ms:
        raise WindowRejected("end_ms must be after start_ms")
    if end_ms - start_ms > MAX_WINDOW_MS:
        raise WindowRejected(f"a window lasts at most {MAX_WINDOW_MS} ms")
    for other_attempt, other_seq, other_start, other_end in existing.get(job_id, []):
        if (other_attempt, other_seq) == (attempt, seq):
            return None  # a replay: already stored
        if start_ms < other_end and other_start < end_ms:
            raise WindowRejected(f"overlaps window {other_attempt}/{other_seq} of job {job_id}")
    existing.setdefault(job_id, []).append((attempt, seq, start_ms, end_ms))
    duration = end_ms - start_ms
    gpu_ms = allocated_gpu_ms(start_ms=start_ms, end_ms=end_ms, gpu_milli=job.gpu_milli)
    sm_util_ms = _int(window, "sm_util_ms", 0)
    if sm_util_ms > duration * max(1, job.gpu_count):
        raise WindowRejected("sm_util_ms exceeds the window's GPU time")
    gpu_model = models_on_node[job_id]
    key = (gpu_model, job.mode, start_ms)
    if key not in prices:
        prices[key] = price_at(gpu_model=gpu_model, mode=job.mode, at_ms=start_ms)
    price = prices[key]
    amount = (
        window_amount(gpu_ms=gpu_ms, per_gpu_hour=price.per_gpu_hour, multiplier=job.priority.price_multiplier)
        if price
        else Decimal(0)
    )
    if price is None:
        log.error("no price for %s %s: window of job %s stored at 0", gpu_model, job.mode, job_id)
    return UsageWindow(
        tenant_id=job.tenant_id,
        job=job,
        node=node,
        attempt=attempt,
        seq=seq,
        start_ms=start_ms,
        end_ms=end_ms,
        gpu_model=gpu_model,
        mode=job.mode,
        gpu_ms=gpu_ms,
        sm_util_ms=sm_util_ms,
        memory_avg_mb=_int(window, "memory_avg_mb", 0),
        memory_peak_mb=_int(window, "memory_peak_mb", 0),
        energy_mj=_int(window, "energy_mj", 0),
        price=price,
        amount=amount,
    )


def _job_totals_add(rows: list[UsageWindow]) -> None:
    totals: dict[int, dict] = {}
    for row in rows:
        t = totals.setdefault(row.job_id, {"cost": Decimal(0), "gpu_ms": 0, "sm": 0, "peak": 0, "energy": 0})
        t["cost"] += row.amount
        t["gpu_ms"] += row.gpu_ms
        t["sm"] += row.sm_util_ms
        t["peak"] = max(t["peak"], row.memory_peak_mb)
        t["energy"] += row.energy_mj
    for job_id, t in totals.items():
        Job.objects.filter(pk=job_id).update(
            cost=F("cost") + t["cost"],
            gpu_ms=F("gpu_ms") + t["gpu_ms"],
            sm_util_ms=F("sm_util_ms") + t["sm"],
            memory_peak_mb=Greatest(F("memory_peak_mb"), t["peak"]),
            energy_mj=F("energy_mj") + t["energy"],
        )
