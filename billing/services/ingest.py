"""Metering ingest and rating: usage windows in, charges out. One transaction per batch."""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from decimal import Decimal
from typing import NamedTuple

from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone
from django_scopes import scopes_disabled
from psycopg2.extras import execute_values

from agents.models import Node
from scheduler.models import Allocation, Job

from .. import rating
from ..models import Charge, Price, TenantDiscount, UsageWindow

log = logging.getLogger(__name__)

# A window longer than this is not something an agent sends: reject it.
MAX_WINDOW_MS = 15 * 60 * 1000
# Memory above this per GPU is not a real card (the largest today is < 200 GB).
MAX_MEMORY_MB_PER_GPU = 1024 * 1024
# Energy above 10 kW per GPU is impossible.
MAX_MILLIWATTS_PER_GPU = 10_000_000


class WindowRejected(ValueError):
    pass


def _int(window: dict, key: str, default: int | None = None) -> int:
    value = window.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WindowRejected(f"{key} must be an integer, got {value!r}")
    if value < 0:
        raise WindowRejected(f"{key} must not be negative")
    return value


class _JobWindows:
    """The windows of one job already stored or accepted: replay and overlap checks in O(log n)."""

    def __init__(self):
        self.keys: set[tuple[int, int]] = set()
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, attempt: int, seq: int, start: int, end: int) -> None:
        self.keys.add((attempt, seq))
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] < end:
            return True
        return i > 0 and self.ends[i - 1] > start


class _Batch:
    """What one ingest batch needs, loaded with a fixed number of queries."""

    def __init__(self, node: Node, windows: list[dict]):
        job_ids = {w.get("job_id") for w in windows if isinstance(w.get("job_id"), int)}
        # Lock the jobs (in id order, so concurrent batches cannot deadlock): the
        # replay and overlap checks below then see every window already stored.
        locked = Job.objects.select_for_update(of=("self",)).filter(pk__in=job_ids).order_by("pk")
        self.jobs = {job.pk: job for job in locked.select_related("priority")}
        self.models_on_node = dict(
            Allocation.objects.filter(job_id__in=job_ids, gpu__node=node).values_list("job_id", "gpu__model")
        )
        # Only stored windows that end after the batch's earliest start can be
        # replays of, or overlap, a window in this batch.
        earliest = min((w["start_ms"] for w in windows if isinstance(w.get("start_ms"), int)), default=0)
        self.stored: dict[int, _JobWindows] = defaultdict(_JobWindows)
        near = UsageWindow.objects.filter(job_id__in=job_ids, end_ms__gt=earliest)
        for job_id, attempt, seq, start, end in near.values_list("job_id", "attempt", "seq", "start_ms", "end_ms"):
            self.stored[job_id].add(attempt, seq, start, end)
        self.prices: dict[tuple[str, str], list[rating.PricePoint]] = defaultdict(list)
        models = set(self.models_on_node.values())
        for p in Price.objects.filter(gpu_model__in=models).order_by("effective_from"):
            point = rating.PricePoint(from_ms=_ms(p.effective_from), per_gpu_hour=p.per_gpu_hour, price_id=p.pk)
            self.prices[(p.gpu_model, p.mode)].append(point)
        self.discounts: dict[int, list[rating.DiscountSpan]] = defaultdict(list)
        tenants = {job.tenant_id for job in self.jobs.values()}
        for d in TenantDiscount.objects.filter(tenant_id__in=tenants):
            until = _ms(d.effective_until) if d.effective_until else None
            self.discounts[d.tenant_id].append(rating.DiscountSpan(_ms(d.effective_from), until, d.percent))


def _ms(value) -> int:
    return int(value.timestamp() * 1000)


@scopes_disabled()
@transaction.atomic
def usage_windows_ingest(*, node: Node, windows: list[dict]) -> dict:
    """Store and rate metering windows exactly once.

    A window is identified by (job, node, attempt, seq): a replay is ignored.
    A window for an unknown job, a job never placed on ``node``, with
    impossible values or overlapping another window of the job is rejected
    and logged, not billed. Each accepted window is split into charges where
    the price, the tenant's discount or the month changes inside it.
    """
    malformed = [w for w in windows if not isinstance(w, dict)]
    if malformed:
        log.warning("usage windows from %s rejected: %d not an object", node.name, len(malformed))
        windows = [w for w in windows if isinstance(w, dict)]
    batch = _Batch(node, windows)
    accepted: list[tuple[_Row, list[rating.Piece]]] = []
    rejected, replays = len(malformed), 0
    for window in windows:
        try:
            result = _window_rate(node, window, batch)
        except WindowRejected as exc:
            rejected += 1
            log.warning("usage window from %s rejected: %s (%r)", node.name, exc, window)
            continue
        if result is None:
            replays += 1
        else:
            accepted.append(result)
    if accepted:
        _rows_insert(accepted)
        _job_totals_add([row for row, _ in accepted])
    return {"stored": len(accepted), "rejected": rejected, "replayed": replays}


class _Row(NamedTuple):
    """A usage window ready to store (a plain tuple: model instances cost more than the insert)."""

    tenant_id: int
    job_id: int
    node_id: int
    attempt: int
    seq: int
    start_ms: int
    end_ms: int
    gpu_model: str
    mode: str
    gpu_ms: int
    sm_util_ms: int
    memory_avg_mb: int
    memory_peak_mb: int
    energy_mj: int
    priority_class: str
    price_id: int | None
    amount: Decimal


_WINDOW_COLUMNS = list(_Row._fields)
_CHARGE_COLUMNS = [
    "tenant_id", "window_id", "job_id", "month", "start_ms", "end_ms", "gpu_model", "mode", "priority_class",
    "price_id", "rate_per_gpu_hour", "gpu_ms", "sm_util_ms", "memory_mb_ms", "energy_mj", "amount",
]  # fmt: skip


def _charge_values(row: _Row, window_id: int, piece: rating.Piece) -> tuple:
    """A charge row, in _CHARGE_COLUMNS order."""
    return (
        row.tenant_id,
        window_id,
        row.job_id,
        piece.month,
        piece.start_ms,
        piece.end_ms,
        row.gpu_model,
        row.mode,
        row.priority_class,
        piece.price_id,
        piece.rate_per_gpu_hour,
        piece.gpu_ms,
        piece.sm_util_ms,
        piece.memory_mb_ms,
        piece.energy_mj,
        piece.amount,
    )


def _rows_insert(accepted: list[tuple[_Row, list[rating.Piece]]]) -> None:
    """Two multi-row INSERTs (windows, then their charges), whatever the batch size."""
    now = timezone.now()
    if connection.vendor != "postgresql":  # the SQLite demo: the ORM's bulk insert
        stored = UsageWindow.objects.bulk_create(
            [UsageWindow(**row._asdict(), received_at=now) for row, _ in accepted], batch_size=500
        )
        charges = [
            Charge(**dict(zip(_CHARGE_COLUMNS, _charge_values(row, window.pk, piece), strict=True)))
            for (row, pieces), window in zip(accepted, stored, strict=True)
            for piece in pieces
        ]
        Charge.objects.bulk_create(charges, batch_size=500)
        return
    window_table, charge_table = UsageWindow._meta.db_table, Charge._meta.db_table
    with connection.cursor() as cursor:
        ids = execute_values(
            cursor.cursor,
            f"INSERT INTO {window_table} ({', '.join(_WINDOW_COLUMNS)}, received_at) VALUES %s RETURNING id",
            [(*row, now) for row, _ in accepted],
            page_size=2000,
            fetch=True,
        )
        charges = [
            _charge_values(row, window_id, piece)
            for (row, pieces), (window_id,) in zip(accepted, ids, strict=True)
            for piece in pieces
        ]
        execute_values(
            cursor.cursor,
            f"INSERT INTO {charge_table} ({', '.join(_CHARGE_COLUMNS)}) VALUES %s",
            charges,
            page_size=2000,
        )


def _window_rate(node: Node, window: dict, batch: _Batch) -> tuple[_Row, list[rating.Piece]] | None:
    job_id = _int(window, "job_id")
    job = batch.jobs.get(job_id)
    if job is None:
        raise WindowRejected(f"unknown job {job_id}")
    if job_id not in batch.models_on_node:
        raise WindowRejected(f"job {job_id} was never placed on node {node.name}")
    seq = _int(window, "seq")
    attempt = _int(window, "attempt", 1)
    if not 1 <= attempt <= max(1, job.attempt):
        raise WindowRejected(f"job {job_id} never had attempt {attempt} (latest is {job.attempt})")
    start_ms, end_ms = _int(window, "start_ms"), _int(window, "end_ms")
    if end_ms <= start_ms:
        raise WindowRejected("end_ms must be after start_ms")
    duration = end_ms - start_ms
    if duration > MAX_WINDOW_MS:
        raise WindowRejected(f"a window lasts at most {MAX_WINDOW_MS} ms")
    stored = batch.stored[job_id]
    if (attempt, seq) in stored.keys:
        return None  # a replay: already stored
    if stored.overlaps(start_ms, end_ms):
        raise WindowRejected(f"window {attempt}/{seq} overlaps another window of job {job_id}")
    gpus = max(1, job.gpu_count)
    sm_util_ms = _int(window, "sm_util_ms", 0)
    if sm_util_ms > duration * gpus:
        raise WindowRejected("sm_util_ms exceeds the window's GPU time")
    memory_avg_mb, memory_peak_mb = _int(window, "memory_avg_mb", 0), _int(window, "memory_peak_mb", 0)
    if memory_peak_mb > MAX_MEMORY_MB_PER_GPU * gpus or memory_avg_mb > MAX_MEMORY_MB_PER_GPU * gpus:
        raise WindowRejected("memory figures exceed any real GPU")
    energy_mj = _int(window, "energy_mj", 0)
    if energy_mj > MAX_MILLIWATTS_PER_GPU * gpus * duration // 1000:
        raise WindowRejected("energy_mj exceeds 10 kW per GPU")
    stored.add(attempt, seq, start_ms, end_ms)

    gpu_model = batch.models_on_node[job_id]
    usage = rating.Usage(
        start_ms=start_ms,
        end_ms=end_ms,
        gpu_milli=job.gpu_milli,
        sm_util_ms=sm_util_ms,
        memory_avg_mb=memory_avg_mb,
        energy_mj=energy_mj,
    )
    pieces = rating.rate_usage(
        usage,
        prices=batch.prices.get((gpu_model, job.mode), []),
        multiplier=job.priority.price_multiplier,
        discounts=batch.discounts.get(job.tenant_id, []),
    )
    if any(p.price_id is None for p in pieces):
        log.error("no price for %s %s: part of a window of job %s rated at 0", gpu_model, job.mode, job_id)
    row = _Row(
        tenant_id=job.tenant_id,
        job_id=job.pk,
        node_id=node.pk,
        attempt=attempt,
        seq=seq,
        start_ms=start_ms,
        end_ms=end_ms,
        gpu_model=gpu_model,
        mode=job.mode,
        priority_class=job.priority.name,
        gpu_ms=sum(p.gpu_ms for p in pieces),
        sm_util_ms=sm_util_ms,
        memory_avg_mb=memory_avg_mb,
        memory_peak_mb=memory_peak_mb,
        energy_mj=energy_mj,
        price_id=pieces[0].price_id,
        amount=sum((p.amount for p in pieces), Decimal(0)),
    )
    return row, pieces


def _job_totals_add(rows: list[_Row]) -> None:
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
