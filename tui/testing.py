"""Test support: a :class:`MonitorSource` fed by hand, and deterministic snapshots.

``FakeSource`` stands in for the daemon: tests ``feed`` it snapshots, ``drop`` and
``restore`` the connection, and read back what the monitor asked of it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable

from kvbroker._wire.stats import (
    ClientStatistics,
    Counters,
    LeaseInfo,
    ObjectInfo,
    PoolStatistics,
    RetentionStatistics,
    RingStatistics,
    SessionInfo,
    Statistics,
    TransferRecord,
)
from kvbroker.errors import BrokerUnavailable

from ._source import Evicted, MonitorSource

__all__ = ["FakeSource", "make_snapshot", "make_object", "make_ring", "make_retention"]

T0 = 1_700_000_000.0  # fixed wall time: snapshots (and their SVGs) never depend on the clock


class FakeSource(MonitorSource):
    label = "fake.sock"

    def __init__(self, objects: Iterable[ObjectInfo] = ()) -> None:
        self.objects = {(o.namespace, o.key): o for o in objects}
        self.up = True
        self.connects = 0
        self.intervals: list[float] = []
        self.list_calls: list[str | None] = []
        self.evicted: list[tuple[str, str]] = []
        self.leased: set[tuple[str, str]] = set()  # objects evict must keep
        self._queue: asyncio.Queue[Statistics | BaseException] = asyncio.Queue()

    # -- driven by the test ----------------------------------------------------------------
    def feed(self, *snapshots: Statistics) -> None:
        for snap in snapshots:
            self._queue.put_nowait(snap)

    def drop(self, reason: str = "the daemon closed the connection") -> None:
        self.up = False
        self._queue.put_nowait(BrokerUnavailable(reason))

    def restore(self) -> None:
        self.up = True

    # -- MonitorSource ---------------------------------------------------------------------
    async def connect(self, interval: float) -> None:
        if not self.up:
            raise BrokerUnavailable("no kvbroker daemon: fake.sock does not exist")
        self.connects += 1
        self.intervals.append(interval)

    async def next_snapshot(self) -> Statistics:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def list_objects(self, match: str | None, limit: int) -> list[ObjectInfo]:
        if not self.up:
            raise BrokerUnavailable("not connected")
        self.list_calls.append(match)
        pattern = re.compile(match) if match else None
        found = [o for o in self.objects.values() if pattern is None or pattern.search(o.key)]
        return found[:limit]

    async def evict(self, namespace: str, key: str) -> Evicted:
        if not self.up:
            raise BrokerUnavailable("not connected")
        if (namespace, key) in self.leased:
            return Evicted(0, 0, 1)
        obj = self.objects.pop((namespace, key), None)
        if obj is None:
            return Evicted(0, 0, 0)
        self.evicted.append((namespace, key))
        return Evicted(1, obj.nbytes, 0)

    async def close(self) -> None:
        pass


def make_object(
    key: str,
    nbytes: int,
    *,
    namespace: str = "default",
    age: float = 10.0,
    readers: int = 0,
    pool: int = 0,
    at: float = T0,
) -> ObjectInfo:
    return ObjectInfo(
        namespace=namespace,
        key=key,
        nbytes=nbytes,
        buffers=2,
        pool=pool,
        readers=readers,
        created_at=at - age,
        last_access=at - age / 2,
    )


def make_ring(
    index: int = 0,
    *,
    capacity: int = 1 << 30,
    used: int = 0,
    device: str = "",
    name: str = "",
    occupancy: str = "",
    **rest,
) -> RingStatistics:
    """A GPU ring's statistics from the few figures a test cares about; the rest follow
    (free space is one free extent, nothing leased)."""
    figures = dict(
        free=capacity - used,
        leased_read=0,
        leased_write=0,
        quarantined=0,
        objects=0,
        largest_free=capacity - used,
        fragmentation=0.0,
        high_watermark=1.0,
        low_watermark=1.0,
    )
    figures.update(rest)
    return RingStatistics(
        index=index,
        device=device,
        name=name,
        capacity=capacity,
        used=used,
        occupancy=occupancy,
        **figures,
    )


def make_snapshot(
    step: int = 0,
    *,
    interval: float = 1.0,
    pools: int = 1,
    rings: Iterable[RingStatistics | dict] = (),
    retention: RetentionStatistics | None = None,
) -> Statistics:
    """Snapshot number ``step`` of a made-up workload: claims move twice what publishes do.

    Everything follows from ``step``, so two runs draw the very same screen.
    ``retention``: the sessions' figures (:func:`make_retention`), none by default.
    """
    mib = 1 << 20
    at = T0 + step * interval
    capacity = 256 * mib
    occupancy = ("sssswwrr.." * 7)[:64] if step % 2 == 0 else ("ssrrww...." * 7)[:64]
    pool_stats = tuple(
        PoolStatistics(
            index=i,
            name=f"/kvbroker-{i}",
            capacity=capacity,
            page_size=64 * 1024,
            used=(96 + 8 * (step % 4)) * mib,
            free=capacity - (96 + 8 * (step % 4)) * mib,
            leased_read=16 * mib,
            leased_write=8 * mib,
            quarantined=0,
            objects=40 + step,
            largest_free=120 * mib,
            fragmentation=0.125,
            high_watermark=0.95,
            low_watermark=0.90,
            occupancy=occupancy,
        )
        for i in range(pools)
    )
    clients = (
        ClientStatistics(
            session=1,
            pid=4101,
            uid=1000,
            gid=1000,
            name="prefill-0",
            role="producer",
            connected_at=T0 - 120,
            read_leases=0,
            write_leases=1,
            bytes_published=step * 10**9,
            bytes_claimed=0,
        ),
        ClientStatistics(
            session=2,
            pid=4102,
            uid=1000,
            gid=1000,
            name="decode-0",
            role="consumer",
            connected_at=T0 - 60,
            read_leases=2,
            write_leases=0,
            bytes_published=0,
            bytes_claimed=step * 2 * 10**9,
        ),
    )
    leases = (
        LeaseInfo(
            lease=11,
            kind="write",
            session=1,
            namespace="llama",
            key=f"req-{step}",
            nbytes=8 * mib,
            expires_in=29.5,
        ),
        LeaseInfo(
            lease=12,
            kind="read",
            session=2,
            namespace="llama",
            key=f"req-{step - 1}",
            nbytes=8 * mib,
            expires_in=28.0,
        ),
    )
    transfers = tuple(
        TransferRecord(
            at=T0 + (step - k) * interval,
            op=op,
            session=s,
            namespace="llama",
            key=f"req-{step - k}",
            nbytes=8 * mib,
        )
        for k in range(3, -1, -1)
        if step - k >= 0
        for op, s in (("publish", 1), ("claim", 2))
    )
    # Per-interval load rises and falls (0.5..1.25 GB in), so sparklines have a shape.
    load = [0.5 + 0.25 * (k % 4) for k in range(1, step + 1)]
    counters = Counters(
        publishes=sum(round(125 * x) for x in load),
        claims=sum(round(250 * x) for x in load),
        bytes_in=round(sum(load) * 10**9),
        bytes_out=round(sum(load) * 2 * 10**9),
        hits=250 * step,
        misses=sum(25 * (k % 3) for k in range(1, step + 1)),
        evictions=sum(3 * (k % 3) for k in range(1, step + 1)),
        evicted_bytes=3 * step * 8 * mib,
        requests=1000 * step,
    )
    return Statistics(
        taken_at=at,
        version="0.1.0",
        pid=4000,
        started_at=T0 - 3600,
        socket="fake.sock",
        objects=40 + step,
        pending=1,
        read_leases=2,
        write_leases=1,
        pools=pool_stats,
        clients=clients,
        counters=counters,
        leases=leases,
        transfers=transfers,
        rings=tuple(r if isinstance(r, RingStatistics) else make_ring(**r) for r in rings),
        retention=retention,
    )


def make_retention(step: int = 0, *, pools: int = 1, sessions: int = 5) -> RetentionStatistics:
    """Sessions' figures that follow from ``step``: session ``k`` holds ``(k + 1) * 4`` MiB,
    last used ``k * 10`` s before the snapshot (:func:`make_snapshot`'s ``taken_at``)."""
    mib = 1 << 20
    at = T0 + step
    largest = tuple(
        SessionInfo(
            namespace="chat",
            name=f"conv-{k}",
            uid=1000,
            priority=k % 3,
            blocks=(k + 1) * 64,
            bytes=(k + 1) * 4 * mib,
            last_use=at - 10 * k,
            expires_in=600.0 - 10 * k,
            created_at=T0 - 600,
        )
        for k in range(sessions)
    )
    held = sum(s.bytes for s in largest)
    return RetentionStatistics(
        sessions=sessions,
        retained_objects=sum(s.blocks for s in largest),
        retained_bytes=(held,) + (0,) * (pools - 1),
        retained_cap=(128 * mib,) * pools,
        tenant_quota=None,
        largest=largest,
        evicted={"pool_full": step},
        dropped={"expired": 2 * step},
    )
