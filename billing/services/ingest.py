"""Metering ingest and rating: usage windows in, charges out. One transaction per batch."""

from __future__ import annotations

import bisect
import functools
import io
import logging
from collections import defaultdict
from datetime import date
from decimal import Decimal
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone
from django_scopes import scopes_disabled
from psycopg2.extras import execute_values

from agents.agent.protocol import WINDOW_FIELDS
from agents.models import Node, QuarantinedWindow
from gpushare.observability.metrics import usage_ingest_observe
from scheduler.models import Allocation, Job

from .. import rating
from ..models import Charge, ChargeBatch, Price, TenantDiscount, UsageWindow

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
        self.now_ms = _ms(timezone.now())
        self.skew_ms = settings.GPUSHARE["NODELINK_CLOCK_SKEW_MS"]
        # The job's allocations (every node): when this node held it (a window must lie inside such a
        # span), and how much GPU time the job can have been billed at most (Σ span × share).
        self.models_on_node: dict[int, str] = {}
        self.spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.held_gpu_ms: dict[int, int] = defaultdict(int)
        allocations = Allocation.objects.filter(job_id__in=job_ids).values_list(
            "job_id", "gpu__node_id", "gpu__model", "share_milli", "created_at", "released_at"
        )
        for job_id, node_id, model, share, created, released in allocations:
            start, end = _ms(created), _ms(released) if released else self.now_ms
            self.held_gpu_ms[job_id] += max(0, end - start + 2 * self.skew_ms) * share // 1000
            if node_id == node.pk:
                self.models_on_node[job_id] = model
                self.spans[job_id].append((start, end))
        self.batch_gpu_ms: dict[int, int] = defaultdict(int)
        # Only stored windows that end after the batch's earliest start can be
        # replays of, or overlap, a window in this batch; as no window lasts
        # over MAX_WINDOW_MS, they start after earliest - MAX_WINDOW_MS (a
        # range of the (job, start_ms) index, however long the job has run).
        earliest = min((w["start_ms"] for w in windows if isinstance(w.get("start_ms"), int)), default=0)
        self.stored: dict[int, _JobWindows] = defaultdict(_JobWindows)
        near = UsageWindow.objects.filter(
            job_id__in=job_ids, start_ms__gt=earliest - MAX_WINDOW_MS, end_ms__gt=earliest
        ).order_by()
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


@scopes_disabled()  # a node's report: windows of every tenant's jobs, checked against the node
@transaction.atomic
def usage_windows_ingest(*, node: Node, windows: list[dict]) -> dict:
    """Store and rate metering windows exactly once.

    A window is identified by (job, node, attempt, seq): a replay is ignored.
    A window for an unknown job, a job never placed on ``node``, with
    impossible values or overlapping another window of the job is rejected
    and logged, not billed. Each accepted window is split into charges where
    the price, the tenant's discount or the month changes inside it.
    """
    quarantine: list[tuple[object, str]] = []
    malformed = [w for w in windows if not isinstance(w, dict)]
    if malformed:
        log.warning("usage windows from %s rejected: %d not an object", node.name, len(malformed))
        quarantine += [({"raw": repr(w)[:1000]}, "not an object") for w in malformed]
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
            quarantine.append((window, str(exc)))
            continue
        if result is None:
            replays += 1
        else:
            accepted.append(result)
    if accepted:
        _rows_insert(accepted)
        _job_totals_add([row for row, _ in accepted])
    if quarantine:
        _quarantine(node, quarantine)
    outcome = {"stored": len(accepted), "rejected": rejected, "replayed": replays}
    usage_ingest_observe(outcome=outcome, end_ms=[row.end_ms for row, _ in accepted])  # counts, ingest lag
    return outcome


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
    "price_id", "rate_per_gpu_hour", "gpu_ms", "sm_util_ms", "memory_mb_ms", "energy_mj", "amount", "batch_id",
]  # fmt: skip


def _charge_values(row: _Row, window_id: int, piece: rating.Piece, batch_id: int) -> tuple:
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
        batch_id,
    )


def _rows_insert(accepted: list[tuple[_Row, list[rating.Piece]]]) -> None:
    """Write the batch's charge batches, windows and charges with a fixed number of statements.

    PostgreSQL: the window ids are drawn from the sequence first, so windows
    and charges go in with one COPY each (no per-row SQL to build or parse).
    Replays never get here (the caller checked under the job locks), and the
    unique constraint still stands behind that check.
    """
    now = timezone.now()
    keys = sorted({(row.tenant_id, piece.month) for row, pieces in accepted for piece in pieces})
    if connection.vendor != "postgresql":  # the SQLite demo: the ORM's bulk insert
        made = ChargeBatch.objects.bulk_create(ChargeBatch(tenant_id=t, month=m) for t, m in keys)
        batches = {(b.tenant_id, b.month): b.pk for b in made}
        stored = UsageWindow.objects.bulk_create(
            [UsageWindow(**row._asdict(), received_at=now) for row, _ in accepted], batch_size=500
        )
        charges = _charges(accepted, [w.pk for w in stored], batches)
        Charge.objects.bulk_create([Charge(**dict(zip(_CHARGE_COLUMNS, c, strict=True))) for c in charges])
        return
    window_table, charge_table = UsageWindow._meta.db_table, Charge._meta.db_table
    with connection.cursor() as cursor, connection.wrap_database_errors:  # psycopg2 errors as Django's
        made = execute_values(
            cursor.cursor,
            f"INSERT INTO {ChargeBatch._meta.db_table} (tenant_id, month, created_at) VALUES %s "
            "RETURNING id, tenant_id, month",
            [(t, m, now) for t, m in keys],
            fetch=True,
        )
        batches = {(tenant_id, month): batch_id for batch_id, tenant_id, month in made}
        cursor.execute(
            "SELECT nextval(%s::regclass) FROM generate_series(1, %s)", [_window_id_sequence(), len(accepted)]
        )
        window_ids = [window_id for (window_id,) in cursor.fetchall()]
        windows = ((window_id, *row, now) for window_id, (row, _) in zip(window_ids, accepted, strict=True))
        raw = cursor.cursor
        raw.copy_expert(
            f"COPY {window_table} (id, {', '.join(_WINDOW_COLUMNS)}, received_at) FROM STDIN", _copy_text(windows)
        )
        raw.copy_expert(
            f"COPY {charge_table} ({', '.join(_CHARGE_COLUMNS)}) FROM STDIN",
            _copy_text(_charges(accepted, window_ids, batches)),
        )


@functools.cache
def _window_id_sequence() -> str:
    """The name of the sequence behind UsageWindow.id (looked up once per process)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [UsageWindow._meta.db_table])
        return cursor.fetchone()[0]


def _charges(
    accepted: list[tuple[_Row, list[rating.Piece]]], window_ids: list[int], batches: dict[tuple[int, date], int]
) -> list[tuple]:
    """Charge rows in _CHARGE_COLUMNS order, each in the batch of its tenant and month."""
    return [
        _charge_values(row, window_id, piece, batches[row.tenant_id, piece.month])
        for (row, pieces), window_id in zip(accepted, window_ids, strict=True)
        for piece in pieces
    ]


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(rows) -> io.StringIO:
    """Rows in COPY's text format.

    NULL is \\N; strings get backslash, tab and newlines escaped; the str() of
    an int, Decimal, date or datetime is what PostgreSQL reads.
    """
    lines = [
        "\t".join([v.translate(_COPY_ESCAPES) if v.__class__ is str else "\\N" if v is None else str(v) for v in row])
        for row in rows
    ]
    lines.append("")
    return io.StringIO("\n".join(lines))


def _quarantine(node: Node, refused: list[tuple[object, str]]) -> None:
    """Keep refused windows with the reason (nothing is silently dropped); a re-sent one is kept once."""

    def key(window) -> tuple:
        return tuple(window.get(k) if isinstance(window, dict) else None for k in ("job_id", "attempt", "seq"))

    def as_int(value):
        return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 62 else None

    job_ids = {as_int(key(w)[0]) for w, _ in refused} - {None}
    kept = set(
        QuarantinedWindow.objects.filter(node=node, job_id__in=job_ids).values_list(
            "job_id", "attempt", "seq", "reason"
        )
    )
    rows = []
    for window, reason in refused:
        job_id, attempt, seq = (as_int(v) for v in key(window))
        if job_id is not None and (job_id, attempt, seq, reason[:300]) in kept:
            continue
        kept.add((job_id, attempt, seq, reason[:300]))
        rows.append(
            QuarantinedWindow(node=node, job_id=job_id, attempt=attempt, seq=seq, window=window, reason=reason[:300])
        )
    QuarantinedWindow.objects.bulk_create(rows)


def _inside_run(node: Node, job: Job, attempt: int, start_ms: int, end_ms: int, batch: _Batch) -> None:
    """A window must lie inside its attempt's run on ``node``: while the node held the job's allocation,
    after the attempt started, before it finished and before now (each within the clock-skew allowance)."""
    skew = batch.skew_ms
    if end_ms > batch.now_ms + skew:
        raise WindowRejected(f"window ends {end_ms - batch.now_ms} ms in the future")
    if not any(held - skew <= start_ms and end_ms <= until + skew for held, until in batch.spans[job.pk]):
        raise WindowRejected(f"window lies outside the times node {node.name} held job {job.pk}")
    if attempt == job.attempt and job.node_id == node.pk:
        if job.started_at is not None and start_ms < _ms(job.started_at) - skew:
            raise WindowRejected(f"window starts before attempt {attempt} of job {job.pk} started")
        if job.finished_at is not None and end_ms > _ms(job.finished_at) + skew:
            raise WindowRejected(f"window ends after attempt {attempt} of job {job.pk} finished")


def _window_rate(node: Node, window: dict, batch: _Batch) -> tuple[_Row, list[rating.Piece]] | None:
    unknown = set(window) - set(WINDOW_FIELDS)
    if unknown:
        raise WindowRejected(f"unknown field(s) {', '.join(sorted(map(str, unknown)))[:100]}")
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
    _inside_run(node, job, attempt, start_ms, end_ms, batch)
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
    # The job's billed GPU time never exceeds the time its GPUs were held (wall x GPUs, every attempt).
    gpu_ms = duration * job.gpu_milli // 1000
    if job.gpu_ms + batch.batch_gpu_ms[job_id] + gpu_ms > batch.held_gpu_ms[job_id]:
        raise WindowRejected(f"billed GPU time of job {job_id} would exceed the time its GPUs were held")
    batch.batch_gpu_ms[job_id] += gpu_ms
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
    """Add the batch to its jobs' running totals: one UPDATE for all the jobs."""
    totals: dict[int, list] = {}
    for row in rows:
        t = totals.setdefault(row.job_id, [Decimal(0), 0, 0, 0, 0])
        t[0] += row.amount
        t[1] += row.gpu_ms
        t[2] += row.sm_util_ms
        t[3] = max(t[3], row.memory_peak_mb)
        t[4] += row.energy_mj
    if connection.vendor != "postgresql":  # the SQLite demo
        for job_id, (cost, gpu_ms, sm, peak, energy) in totals.items():
            Job.objects.filter(pk=job_id).update(
                cost=F("cost") + cost,
                gpu_ms=F("gpu_ms") + gpu_ms,
                sm_util_ms=F("sm_util_ms") + sm,
                memory_peak_mb=Greatest(F("memory_peak_mb"), peak),
                energy_mj=F("energy_mj") + energy,
            )
        return
    with connection.cursor() as cursor, connection.wrap_database_errors:
        execute_values(
            cursor.cursor,
            f"UPDATE {Job._meta.db_table} j SET cost = j.cost + v.cost, gpu_ms = j.gpu_ms + v.gpu_ms, "
            "sm_util_ms = j.sm_util_ms + v.sm, memory_peak_mb = GREATEST(j.memory_peak_mb, v.peak), "
            "energy_mj = j.energy_mj + v.energy "
            "FROM (VALUES %s) AS v (id, cost, gpu_ms, sm, peak, energy) WHERE j.id = v.id",
            [(job_id, *t) for job_id, t in sorted(totals.items())],
            template="(%s, %s::numeric, %s::bigint, %s::bigint, %s::integer, %s::bigint)",
        )
