"""One shape for host pools and GPU rings, so a single panel draws both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbroker._wire.stats import PoolStatistics

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
            key=f"pool-{p.index}", title=f"pool {p.index}  {p.name}", capacity=p.capacity,
            used=p.used, free=p.free, leased_read=p.leased_read, leased_write=p.leased_write,
            quarantined=p.quarantined, objects=p.objects, largest_free=p.largest_free,
            fragmentation=p.fragmentation, high_watermark=p.high_watermark,
            low_watermark=p.low_watermark, occupancy=p.occupancy,
        )  # fmt: skip

    @classmethod
    def from_ring(cls, position: int, r: dict[str, Any]) -> PoolView:
        # Rings arrive as plain dicts (GPU support is optional); read them forgivingly.
        index = r.get("index", position)
        capacity = int(r.get("capacity", 0))
        used = int(r.get("used", 0))
        label = r.get("name") or r.get("device") or ""
        return cls(
            key=f"ring-{index}", title=f"ring {index}  {label}".rstrip(), capacity=capacity,
            used=used, free=int(r.get("free", capacity - used)),
            leased_read=int(r.get("leased_read", 0)), leased_write=int(r.get("leased_write", 0)),
            quarantined=int(r.get("quarantined", 0)), objects=int(r.get("objects", 0)),
            largest_free=int(r.get("largest_free", capacity - used)),
            fragmentation=float(r.get("fragmentation", 0.0)),
            high_watermark=float(r.get("high_watermark", 1.0)),
            low_watermark=float(r.get("low_watermark", 1.0)),
            occupancy=str(r.get("occupancy", "")),
        )  # fmt: skip
