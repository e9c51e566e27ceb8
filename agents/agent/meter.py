"""Per-job metering windows (pure: no I/O).

Each sample adds the interval since the previous one to the job's open
window; a window closes when it reaches the configured length or when the job
ends. Windows are numbered per job attempt (``seq`` from 0) so the platform
ingests each exactly once, and consecutive windows share their boundary, so
their durations add up to exactly the time the job held its GPUs.
"""

from __future__ import annotations

from .protocol import UsageWindow as Window  # the window's fields are declared once, in the protocol

__all__ = ["JobMeter", "Window", "split_energy"]


class JobMeter:
    def __init__(self, *, job_id: int, attempt: int, start_ms: int, window_ms: int, seq: int = 0):
        if window_ms <= 0:
            raise ValueError("window_ms must be positive")
        self.job_id = job_id
        self.attempt = attempt
        self.window_ms = window_ms
        self.seq = seq
        self._start = self._last = start_ms
        self._sm = 0.0
        self._mem_ms = 0.0
        self._peak = 0
        self._energy = 0.0

    @property
    def window_start_ms(self) -> int:
        return self._start

    def add(self, *, at_ms: int, sm_util_pct: float, memory_mb: int, energy_mj: float) -> Window | None:
        """Account the interval up to ``at_ms``; return a window if one closed."""
        dt = at_ms - self._last
        if dt <= 0:
            return None
        self._sm += max(0.0, sm_util_pct) / 100 * dt
        self._mem_ms += max(0, memory_mb) * dt
        self._peak = max(self._peak, memory_mb)
        self._energy += max(0.0, energy_mj)
        self._last = at_ms
        if at_ms - self._start >= self.window_ms:
            return self._close()
        return None

    def close(self, at_ms: int) -> Window | None:
        """Close the open window at ``at_ms`` (the job ended)."""
        if at_ms > self._last:
            self._last = at_ms
        if self._last <= self._start:
            return None
        return self._close()

    def _close(self) -> Window:
        duration = self._last - self._start
        window = Window(
            job_id=self.job_id,
            attempt=self.attempt,
            seq=self.seq,
            start_ms=self._start,
            end_ms=self._last,
            sm_util_ms=min(int(round(self._sm)), duration * 8),
            memory_avg_mb=int(self._mem_ms / duration),
            memory_peak_mb=self._peak,
            energy_mj=int(round(self._energy)),
        )
        self.seq += 1
        self._start = self._last
        self._sm = self._mem_ms = self._energy = 0.0
        self._peak = 0
        return window


def split_energy(delta_mj: float, weights: dict[int, float]) -> dict[int, float]:
    """Split a GPU's energy delta between its jobs in proportion to ``weights``."""
    total = sum(w for w in weights.values() if w > 0)
    if not weights:
        return {}
    if total <= 0:
        share = delta_mj / len(weights)
        return {job: share for job in weights}
    return {job: delta_mj * max(0.0, w) / total for job, w in weights.items()}
