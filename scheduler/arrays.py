"""Job array indices: the grammar of ``array`` in ``POST /api/v1/jobs/``. Pure (no Django).

Two forms, as in Slurm's ``sbatch --array``:

- ``{"count": N}``: indices ``0 .. N-1``;
- ``{"range": "EXPR"}`` where EXPR is a comma-separated list of items, each
  ``I`` (one index), ``A-B`` (A to B inclusive) or ``A-B:S`` (A, A+S, ... up
  to B), e.g. ``1-1000``, ``0-99:2``, ``1,3,5-7``. Indices are whole numbers
  from 0 to ``MAX_INDEX``; repeated indices are refused, and so are more than
  ``MAX_TASKS`` tasks in one array.

Slurm's ``%N`` suffix (at most N tasks running at once) is refused with a
message that says so: not supported yet.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_TASKS = 10_000
MAX_INDEX = 9_999_999

_ITEM = re.compile(r"^(\d{1,7})(?:-(\d{1,7})(?::(\d{1,7}))?)?$")


class ArrayError(ValueError):
    """An ``array`` the grammar refuses; the message says what is allowed."""


@dataclass(frozen=True)
class ArraySpec:
    # In the order given: a ``range`` for a count or one ``A-B[:S]`` item (the common forms, checked and
    # counted without listing 1,000 numbers on the submit path), else a tuple.
    indices: Sequence[int]
    expression: str  # normalised: what was asked, as stored and shown

    @property
    def count(self) -> int:
        return len(self.indices)


def _check_count(n: int) -> None:
    if n > MAX_TASKS:
        raise ArrayError(f"an array has at most {MAX_TASKS:,} tasks (this one would have {n:,})")


def array_parse(value) -> ArraySpec:
    """The array asked for in the API's ``array`` field (a dict), or :class:`ArrayError`."""
    if not isinstance(value, dict) or set(value) - {"count", "range"} or len(value) != 1:
        raise ArrayError('array is {"count": N} or {"range": "1-1000"} (one of the two)')
    if "count" in value:
        count = value["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ArrayError("array.count is a whole number of tasks, at least 1")
        _check_count(count)
        return ArraySpec(indices=range(count), expression=f"0-{count - 1}" if count > 1 else "0")
    return range_parse(value["range"])


def range_parse(text) -> ArraySpec:
    """``"1-1000"``, ``"0-99:2"``, ``"1,3,5-7"`` -> the indices, in the order given."""
    if not isinstance(text, str) or not text.strip() or len(text) > 400:
        raise ArrayError('array.range is a string such as "1-1000", "0-99:2" or "1,3,5-7"')
    if "%" in text:
        raise ArrayError("a %N throttle (tasks running at once) is not supported yet: leave it out")
    items: list[range] = []
    total = 0
    for item in text.replace(" ", "").split(","):
        match = _ITEM.match(item)
        if not match:
            raise ArrayError(f"'{item}' is not an index, A-B or A-B:STEP (e.g. 1-1000, 0-99:2)")
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        step = int(match.group(3)) if match.group(3) is not None else 1
        if end < start:
            raise ArrayError(f"'{item}': the range ends before it starts")
        if step < 1:
            raise ArrayError(f"'{item}': the step is at least 1")
        if end > MAX_INDEX:
            raise ArrayError(f"'{item}': indices go up to {MAX_INDEX:,}")
        items.append(range(start, end + 1, step))
        total += len(items[-1])
        _check_count(total)
    expression = text.replace(" ", "")
    if len(items) == 1:
        return ArraySpec(indices=items[0], expression=expression)
    indices: list[int] = []
    seen: set[int] = set()
    for index in (i for item in items for i in item):
        if index in seen:
            raise ArrayError(f"index {index} is given twice")
        seen.add(index)
        indices.append(index)
    return ArraySpec(indices=tuple(indices), expression=expression)
