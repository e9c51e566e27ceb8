"""Pure helpers for the benchmark harness: statistics, ratios and the table.

No Django, no processes: easy to test (tests/bench/test_stats.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) with linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError("p must be between 0 and 100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def rate(count: int, seconds: float) -> float:
    """Events per second; 0 when nothing was measured."""
    return count / seconds if seconds > 0 else 0.0


@dataclass
class Row:
    """One line of the results table: our figure against a reference figure.

    ``higher_is_better`` says how to read the ratio; ``goal`` is the target
    the ratio or the figure is checked against (see ``goal_met``).
    """

    bench: str
    metric: str
    ours: float | None
    unit: str
    reference: float | None = None
    reference_name: str = ""
    higher_is_better: bool = True
    goal: str = ""
    goal_met: bool | None = None
    runs: int = 1
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """ours / reference when higher is better, reference / ours otherwise: > 1 means we are ahead."""
        if self.ours is None or self.reference is None:
            return None
        if self.higher_is_better:
            return self.ours / self.reference if self.reference else None
        return self.reference / self.ours if self.ours else None

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def fmt_number(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def goal_mark(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]


HEADERS = ("benchmark", "metric", "ours", "reference", "ref", "ratio", "goal", "met", "runs")


def table_rows(rows: Sequence[Row]) -> list[tuple[str, ...]]:
    out = []
    for row in rows:
        ratio = row.ratio
        out.append(
            (
                row.bench,
                row.metric,
                f"{fmt_number(row.ours)} {row.unit}".strip(),
                f"{fmt_number(row.reference)} {row.unit}".strip() if row.reference is not None else "-",
                row.reference_name or "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                row.goal or "-",
                goal_mark(row.goal_met),
                str(row.runs),
            )
        )
    return out


def table_text(rows: Sequence[Row]) -> str:
    """A fixed-width table for the terminal."""
    body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def table_markdown(rows: Sequence[Row]) -> str:
    """The same table in Markdown, for docs/benchmarks.md."""
    body = table_rows(rows)
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    return "\n".join(lines)
