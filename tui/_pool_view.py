"""One shape for host pools and GPU rings, so a single panel draws both."""

from __future__ import annotations

from dataclasses import dataclass
from kvbroker._wire.stats import PoolStatistics, RingStatistics

__all__ = ["PoolView"]


@dataclass(frozen=True)
class PoolView:
    key: str  # stable across snapshots: the panel showing it is found by this
    title: str
    capacity: int
    used: int
    free: int
    leased_read: int
    leased_write: int
    quarantined: int
    objects: int
    largest_free: int
    fragmentation: float
    high_watermark: float
    low_watermark: float
    occupancy: str

    @property
    def leased(self) -> int:
        return self.leased_read + self.leased_write

    @classmethod
    def from_pool(cls, p: PoolStatistics) -> PoolView:
        return cls(
            key=f"pool-{p.index}",
            title=f"pool {p.index}  {p.name}",
            capacity=p.capacity,
            used=p.used,
            free=p.free,
            leased_read=p.leased_read,
            leased_write=p.leased_write,
            quarantined=p.quarantined,
            objects=p.objects,
            largest_free=p.largest_free,
            fragmentation=p.fragmentation,
            high_watermark=p.high_watermark,
            low_watermark=p.low_watermark,
            occupancy=p.occupancy,
        )

    @classmethod
    def from_ring(cls, position: int, r: RingStatistics) -> PoolView:
        # `position` (the ring's place in the snapshot) only mattered while rings came
        # untyped and might lack their index; a RingStatistics carries it.
        return cls(
            key=f"ring-{r.index}",
            title=f"ring {r.index}  {r.name or r.device}".rstrip(),
            capacity=r.capacity,
            used=r.used,
            free=r.free,
            leased_read=r.leased_read,
            leased_write=r.leased_write,
            quarantined=r.quarantined,
            objects=r.objects,
            largest_free=r.largest_free,
            fragmentation=r.fragmentation,
            high_watermark=r.high_watermark,
            low_watermark=r.low_watermark,
            occupancy=r.occupancy,
        )
