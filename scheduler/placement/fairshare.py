"""Fair share between tenants: usage decayed with a half-life, compared to weights.

A tenant's *standing* is its decayed past usage plus what it holds now
projected over the decay's mean life, divided by its weight. The tenant with
the lowest standing is the furthest below its weighted share and goes first
among jobs of one priority class (Slurm's fair-share factor and Kueue's
admission fair sharing order by the same quantity). Placing a job raises its
tenant's standing at once, so one pass interleaves tenants by weight instead
of handing the whole fleet to whoever was behind at the start of the pass.

Units: usage in milli-GPU x milliseconds.
"""

from __future__ import annotations

import math

LN2 = math.log(2)


def mean_life_ms(half_life_ms: int) -> float:
    return half_life_ms / LN2


def usage_decay(usage: float, *, elapsed_ms: float, half_life_ms: int) -> float:
    """``usage`` as it weighs ``elapsed_ms`` later."""
    if elapsed_ms <= 0:
        return usage
    return usage * 0.5 ** (elapsed_ms / half_life_ms)


def usage_accumulate(usage: float, *, milli: float, duration_ms: float, half_life_ms: int) -> float:
    """Decayed usage after holding ``milli`` for ``duration_ms`` (continuous decay, exact)."""
    if duration_ms <= 0:
        return usage
    kept = 0.5 ** (duration_ms / half_life_ms)
    return usage * kept + milli * mean_life_ms(half_life_ms) * (1 - kept)


def standing(*, usage: float, held_milli: float, weight: float, half_life_ms: int) -> float:
    """Lower is further below the weighted share (goes first)."""
    return (usage + held_milli * mean_life_ms(half_life_ms)) / max(weight, 1e-9)
