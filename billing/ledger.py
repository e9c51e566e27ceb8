"""The GPU-second ledger, pure: no Django.

For one GPU over one month (from its registration, if later; up to now for
the current month) every millisecond is one of:

- **held**: billed to a tenant — a whole GPU, or slices adding up to at most
  one GPU (``share_milli`` thousandths each),
- **out of service**: inside a GpuOutage (health event, node down, operator),
- **idle**: in service and not held.

Quantities are in milli-GPU-milliseconds (share × ms), so slices are exact:
``held + out_of_service + idle == capacity``. What would break that identity
is reported as a problem, and ``ledger_check`` fails on any:

- *overlap*: at some instant the GPU is held more than once over (shares
  above 1000), or billed while out of service;
- *unattributed*: a charge whose GPU cannot be found (no allocation of the
  job on that node at that time), i.e. money not tied to any capacity;
- *gap*: a hole between consecutive metering windows of one job attempt,
  i.e. held time that was never metered (lost or rejected windows).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

FULL = 1000  # milli-GPU in one GPU


@dataclass(frozen=True)
class Held:
    start_ms: int
    end_ms: int
    share_milli: int
    job_id: int
    amount: Decimal = Decimal(0)


@dataclass
class GpuLedger:
    gpu_id: int
    node: str
    model: str
    start_ms: int  # in service from (registration or month start)
    end_ms: int
    held: int = 0  # milli-GPU-ms
    out_of_service: int = 0  # milli-GPU-ms
    revenue: Decimal = Decimal(0)
    problems: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return max(0, self.end_ms - self.start_ms) * FULL

    @property
    def idle(self) -> int:
        return self.capacity - self.held - self.out_of_service

    @property
    def available(self) -> int:
        return self.capacity - self.out_of_service

    @property
    def utilisation(self) -> Decimal | None:
        return (Decimal(self.held) / self.available).quantize(Decimal("0.0001")) if self.available > 0 else None


def _clip(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    start, end = max(start, lo), min(end, hi)
    return (start, end) if end > start else None


def gpu_ledger(
    *, gpu_id: int, node: str, model: str, start_ms: int, end_ms: int, held: list[Held], outages: list[tuple]
) -> GpuLedger:
    """Sweep the GPU's timeline once: sum held and out-of-service time, find overlaps."""
    ledger = GpuLedger(gpu_id=gpu_id, node=node, model=model, start_ms=start_ms, end_ms=end_ms)
    # (t, 0 for an end / 1 for a start: ends sort first, held share delta, outage depth delta)
    events: list[tuple[int, int, int, int]] = []
    for h in held:
        ledger.revenue += h.amount
        span = _clip(h.start_ms, h.end_ms, start_ms, end_ms)
        if span != (h.start_ms, h.end_ms):
            ledger.problems.append(
                f"overlap: job {h.job_id} billed on GPU {node}#{gpu_id} outside its service period "
                f"[{h.start_ms}, {h.end_ms})"
            )
        if span is not None:
            events += [(span[0], 1, h.share_milli, 0), (span[1], 0, -h.share_milli, 0)]
    for o_start, o_end in outages:
        span = _clip(o_start, o_end, start_ms, end_ms)
        if span is not None:
            events += [(span[0], 1, 0, 1), (span[1], 0, 0, -1)]
    events.sort()
    share = out_depth = 0
    prev = start_ms
    for t, _, share_delta, out_delta in events:
        if t > prev:
            length = t - prev
            ledger.held += share * length
            if out_depth:
                ledger.out_of_service += length * FULL
            if share > FULL:
                ledger.problems.append(f"overlap: GPU {node}#{gpu_id} held {share / FULL:g}x over [{prev}, {t})")
            if share and out_depth:
                ledger.problems.append(f"overlap: GPU {node}#{gpu_id} billed while out of service [{prev}, {t})")
            prev = t
        share += share_delta
        out_depth += out_delta
    return ledger


@dataclass(frozen=True)
class Metered:
    """A metered (rated) piece of one job attempt on one node, for the gap check."""

    job_id: int
    node_id: int
    attempt: int
    start_ms: int
    end_ms: int


def metering_gaps(pieces: list[Metered], *, limit: int = 20) -> list[str]:
    """Holes between consecutive windows of the same job attempt on the same node."""
    by_run: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for p in pieces:
        by_run[(p.job_id, p.node_id, p.attempt)].append((p.start_ms, p.end_ms))
    problems = []
    for (job_id, _, attempt), spans in sorted(by_run.items()):
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            if start > end:
                problems.append(f"gap: job {job_id} attempt {attempt} unmetered for {start - end} ms from {end}")
                if len(problems) >= limit:
                    return problems
    return problems


@dataclass(frozen=True)
class LedgerTotals:
    key: str
    gpus: int
    capacity: int
    held: int
    out_of_service: int
    idle: int
    revenue: Decimal

    @property
    def utilisation(self) -> Decimal | None:
        available = self.capacity - self.out_of_service
        return (Decimal(self.held) / available).quantize(Decimal("0.0001")) if available > 0 else None


def totals_by(ledgers: list[GpuLedger], key) -> list[LedgerTotals]:
    groups: dict[str, list[GpuLedger]] = defaultdict(list)
    for g in ledgers:
        groups[key(g)].append(g)
    return [
        LedgerTotals(
            key=k,
            gpus=len(gs),
            capacity=sum(g.capacity for g in gs),
            held=sum(g.held for g in gs),
            out_of_service=sum(g.out_of_service for g in gs),
            idle=sum(g.idle for g in gs),
            revenue=sum((g.revenue for g in gs), Decimal(0)),
        )
        for k, gs in sorted(groups.items())
    ]
