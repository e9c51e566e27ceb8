"""An endpoint's history for charts and the metrics API: traffic, latency, replicas, cost.

Traffic and latency come from the gateway's per-minute rows (EndpointMinute);
replicas over time from the replicas' own start/ready/stop times (true even
while no gateway runs); cost per day from the metered usage windows of the
replicas' jobs, the same rows the invoice is made of.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import BigIntegerField, ExpressionWrapper, F, Q, Sum
from django.utils import timezone

from billing.models import UsageWindow

from .models import Endpoint, EndpointMinute, Replica

MS_PER_DAY = 86_400_000


@dataclass(frozen=True)
class Window:
    name: str
    span: timedelta
    step_s: int  # one chart point per step (a multiple of 60: whole minutes)
    step_label: str


WINDOWS = {
    w.name: w
    for w in (
        Window("1h", timedelta(hours=1), 60, "minute"),
        Window("6h", timedelta(hours=6), 300, "5 minutes"),
        Window("24h", timedelta(hours=24), 900, "15 minutes"),
        Window("7d", timedelta(days=7), 3600, "hour"),
    )
}
DEFAULT_WINDOW = "1h"


def window_named(name: str | None) -> Window:
    """The named window; an unknown name is a ValueError that lists the known ones."""
    if not name:
        return WINDOWS[DEFAULT_WINDOW]
    if name not in WINDOWS:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}")
    return WINDOWS[name]


def _buckets(window: Window, now: datetime) -> list[datetime]:
    """Bucket starts, oldest first; the last bucket holds ``now``."""
    step = window.step_s
    last = datetime.fromtimestamp(int(now.timestamp()) // step * step, tz=UTC)
    count = int(window.span.total_seconds()) // step
    return [last - timedelta(seconds=step * i) for i in range(count - 1, -1, -1)]


def traffic_series(endpoint: Endpoint, *, window: Window, now: datetime | None = None) -> dict:
    """Per bucket: requests per second, errors, latency p50/p95/p99 (ms), replicas live and ready.

    A bucket longer than a minute merges its minutes: p50 is their
    request-weighted mean, p95 and p99 the worst minute's (percentiles do not
    add up; this errs on the side of showing a bad minute).
    """
    now = now or timezone.now()
    starts = _buckets(window, now)
    step = window.step_s
    index = {int(s.timestamp()): i for i, s in enumerate(starts)}
    n = len(starts)
    requests, errors = [0] * n, [0] * n
    p50_weighted, p50_weight = [0] * n, [0] * n
    p95: list[int | None] = [None] * n
    p99: list[int | None] = [None] * n
    minutes = EndpointMinute.objects.filter(endpoint=endpoint, minute__gte=starts[0]).values_list(
        "minute", "requests", "errors", "p50_ms", "p95_ms", "p99_ms"
    )
    for minute, reqs, errs, m50, m95, m99 in minutes:
        i = index.get(int(minute.timestamp()) // step * step)
        if i is None:
            continue
        requests[i] += reqs
        errors[i] += errs
        if m50 is not None and reqs:
            p50_weighted[i] += m50 * reqs
            p50_weight[i] += reqs
        if m95 is not None:
            p95[i] = max(p95[i] or 0, m95)
        if m99 is not None:
            p99[i] = max(p99[i] or 0, m99)
    live, ready = _replica_counts(endpoint, starts, step, now)
    return {
        "window": window.name,
        "step_seconds": step,
        "t": [int(s.timestamp() * 1000) for s in starts],
        "requests": requests,
        "requests_per_s": [round(r / step, 3) for r in requests],
        "errors": errors,
        "p50_ms": [round(w / c) if c else None for w, c in zip(p50_weighted, p50_weight, strict=True)],
        "p95_ms": p95,
        "p99_ms": p99,
        "replicas": live,
        "replicas_ready": ready,
    }


def _replica_counts(endpoint: Endpoint, starts: list[datetime], step: int, now: datetime) -> tuple[list, list]:
    """The most replicas alive, and ready, at any moment of each bucket (a replica that lived
    for seconds still shows)."""
    first = starts[0]
    rows = list(
        Replica.objects.filter(endpoint=endpoint, created_at__lte=now)
        .filter(Q(stopped_at__isnull=True) | Q(stopped_at__gt=first))
        .values_list("created_at", "ready_at", "drain_started_at", "stopped_at")
    )
    live = [(created, stopped) for created, _, _, stopped in rows]
    ready = [(r, d or s) for _, r, d, s in rows if r is not None]
    return _peaks(live, starts, step, now), _peaks(ready, starts, step, now)


def _peaks(intervals: list[tuple], starts: list[datetime], step: int, now: datetime) -> list[int]:
    """Per bucket, the most of ``intervals`` ([begin, end), end None: still open) overlapping at once."""
    # At equal times an end sorts before a begin: a replica replaced at that instant is not counted twice.
    events = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals if e is not None])
    count, i, out = 0, 0, []
    for start in starts:
        end = min(start + timedelta(seconds=step), now)
        while i < len(events) and events[i][0] <= start:
            count += events[i][1]
            i += 1
        peak = count
        while i < len(events) and events[i][0] < end:
            count += events[i][1]
            i += 1
            peak = max(peak, count)
        out.append(peak)
    return out


def cost_by_day(endpoint: Endpoint, *, days: int = 30, now: datetime | None = None) -> list[dict]:
    """The last ``days`` UTC days, oldest first: replica GPU-milliseconds and cost (Decimal) per day."""
    now = now or timezone.now()
    today = int(now.timestamp() * 1000) // MS_PER_DAY
    first = today - days + 1
    day = ExpressionWrapper(F("start_ms") / MS_PER_DAY, output_field=BigIntegerField())
    rows = (
        UsageWindow.objects.filter(tenant_id=endpoint.tenant_id, job__replica__endpoint=endpoint)
        .filter(start_ms__gte=first * MS_PER_DAY)
        .annotate(day=day)
        .values("day")
        .annotate(gpu_ms=Sum("gpu_ms"), amount=Sum("amount"))
    )
    found = {row["day"]: row for row in rows}
    out = []
    for d in range(first, today + 1):
        row = found.get(d, {})
        out.append(
            {
                "date": datetime.fromtimestamp(d * MS_PER_DAY / 1000, tz=UTC).date(),
                "gpu_ms": row.get("gpu_ms") or 0,
                "amount": row.get("amount") or Decimal(0),
            }
        )
    return out


def recent_traffic(endpoints: list[Endpoint], *, minutes: int = 60) -> dict[int, dict]:
    """Endpoint id -> requests and worst p95 (ms) over the last ``minutes``: the list page's columns."""
    since = timezone.now() - timedelta(minutes=minutes)
    out: dict[int, dict] = {e.pk: {"requests": 0, "errors": 0, "p95_ms": None} for e in endpoints}
    rows = EndpointMinute.objects.filter(endpoint__in=endpoints, minute__gte=since).values_list(
        "endpoint_id", "requests", "errors", "p95_ms"
    )
    for endpoint_id, reqs, errs, p95 in rows:
        row = out[endpoint_id]
        row["requests"] += reqs
        row["errors"] += errs
        if p95 is not None:
            row["p95_ms"] = max(row["p95_ms"] or 0, p95)
    return out
