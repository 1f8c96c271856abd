"""Rates from consecutive snapshots: the daemon only keeps counters, the monitor divides.

Each snapshot carries cumulative counters and the wall time it was taken; the difference
between two, over the time between them, is the rate for that interval. A counter going
backwards means the daemon restarted, and the history starts again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbroker._wire.stats import Counters, Statistics

__all__ = ["Rates", "RateHistory"]

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """What happened between two snapshots, per second (hit rate: a fraction, or None when
    nothing was looked up in that interval)."""

    publish_gbps: float = 0.0
    claim_gbps: float = 0.0
    publish_ops: float = 0.0
    claim_ops: float = 0.0
    hit_rate: float | None = None
    evictions: float = 0.0

    @classmethod
    def between(cls, before: Statistics, after: Statistics) -> Rates | None:
        dt = after.taken_at - before.taken_at
        a, b = before.counters, after.counters
        if dt <= 0 or _went_backwards(a, b):
            return None
        hits, misses = b.hits - a.hits, b.misses - a.misses
        return cls(
            publish_gbps=(b.bytes_in - a.bytes_in) / dt / GB,
            claim_gbps=(b.bytes_out - a.bytes_out) / dt / GB,
            publish_ops=(b.publishes - a.publishes) / dt,
            claim_ops=(b.claims - a.claims) / dt,
            hit_rate=hits / (hits + misses) if hits + misses else None,
            evictions=(b.evictions - a.evictions) / dt,
        )


def _went_backwards(a: Counters, b: Counters) -> bool:
    return b.requests < a.requests or b.bytes_in < a.bytes_in or b.bytes_out < a.bytes_out


class RateHistory:
    """The last ``length`` intervals' rates, oldest first, for the sparklines."""

    def __init__(self, length: int = 120) -> None:
        self.samples: deque[Rates] = deque(maxlen=length)
        self._last: Statistics | None = None

    def add(self, snapshot: Statistics) -> Rates | None:
        """Take a snapshot; returns the rates of the interval it closes, if there is one."""
        last, self._last = self._last, snapshot
        if last is None:
            return None
        if snapshot.pid != last.pid or snapshot.started_at != last.started_at:
            self.samples.clear()  # another daemon: its counters are not comparable
            return None
        rates = Rates.between(last, snapshot)
        if rates is None:
            self.samples.clear()
            return None
        self.samples.append(rates)
        return rates

    @property
    def latest(self) -> Rates | None:
        return self.samples[-1] if self.samples else None

    def raw_series(self, field: str) -> list[float | None]:
        """One rate over time, None where it was not measured (no lookups: no hit rate)."""
        return [getattr(r, field) for r in self.samples]

    def series(self, field: str) -> list[float]:
        """One rate over time; hit-rate gaps (no lookups) count as 0 so the line stays whole."""
        return [getattr(r, field) or 0.0 for r in self.samples]
