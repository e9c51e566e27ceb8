"""The side-by-side workload, pure: which jobs, in which order, with which request.

Each job is a trivial command that takes 1 whole GPU, 1/2, 1/4 or 1/8 of one,
cycling. Shard jobs are submitted first: Debian's Slurm 22.05 can hand the
same GPU to a whole-GPU job and to shard jobs when they interleave (fixed
upstream in 23.11.5), and that would flatter its drain rate.
"""

from __future__ import annotations

from .slurm import gres_for_fraction

CYCLE_MILLI = (1000, 500, 250, 125)


def workload(n: int) -> list[int]:
    """``n`` GPU shares in thousandths, cycling 1, 1/2, 1/4, 1/8; the slices first."""
    shares = [CYCLE_MILLI[i % len(CYCLE_MILLI)] for i in range(n)]
    return sorted(shares, key=lambda milli: milli == 1000)


def api_body(milli: int, command: str) -> dict:
    """Our API's request for one job of the workload."""
    whole = milli % 1000 == 0
    return {
        "kind": "training" if whole else "inference",
        "gpus": milli // 1000 if whole else milli / 1000,
        "command": ["sh", "-c", command],
    }


def slurm_gres(milli: int) -> str:
    return gres_for_fraction(milli)


def chunks(items: list, parts: int) -> list[list]:
    """Split ``items`` into ``parts`` contiguous, nearly equal pieces (one per client)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
