"""The daemon's statistics: the broker's state read into the frozen types of
:mod:`kvbroker._wire.stats` (trio's ``statistics()`` style).

``stat`` and ``watch`` send :meth:`Statistics.to_dict` of what :func:`statistics_for` builds;
the Prometheus endpoint (:mod:`kvbroker._server.metrics`) reads the same objects. What the
figures mean (leased, quarantined, ...): see the ownership contract in
:mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._version import __version__
from .._wire.stats import (
    ClientStatistics,
    Counters,
    LeaseInfo,
    NamespaceUsage,
    PoolStatistics,
    Statistics,
    TransferRecord,
)
from .pool import HostPool
from .state import Session, StoredObject

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["statistics", "statistics_for"]

_MAX_REPORTED_LEASES = 256
_MAX_NAMESPACES = 1000  # rows of per-namespace usage in a snapshot


def statistics(b: Broker, occupancy_cells: int = 64) -> Statistics:
    """Everything the daemon can say about itself, as an operator (admin) sees it."""
    now = b.clock()
    reads = sum(1 for ls in b.leases.values() if ls.kind == "read")
    fleet = b.fleet.statistics() if b.fleet is not None else (None, None)
    return Statistics(
        taken_at=time.time(),
        version=__version__,
        pid=os.getpid(),
        started_at=b.started_at,
        socket=b.socket_path,
        objects=len(b.objects),
        pending=len(b.pending),
        read_leases=reads,
        write_leases=len(b.leases) - reads,
        arenas=len(b.arenas),
        read_replicas=len(b.replica_paths),
        pools=_pools(b, occupancy_cells),
        clients=tuple(_client(s) for s in b.sessions.values()),
        counters=Counters(**b.counters),
        leases=tuple(
            LeaseInfo(lease=ls.id, kind=ls.kind, session=ls.session.id,
                      namespace=ls.obj.namespace, key=ls.obj.key,
                      nbytes=sum(o.nbytes for o in ls.objects()),
                      expires_in=ls.expires_at - now)
            for ls in list(b.leases.values())[-_MAX_REPORTED_LEASES:]
        ),  # fmt: skip
        transfers=tuple(TransferRecord(*t) for t in b.transfers),
        namespaces=_namespace_usage(b),
        rings=b.rings.statistics(occupancy_cells) if b.rings is not None else (),
        transfer=fleet[0],
        events=fleet[1],
        retention=b.retention.statistics(),
    )


def statistics_for(b: Broker, session: Session, occupancy_cells: int = 64) -> Statistics:
    """The statistics as this connection may see them: under a tenant policy, the names of
    namespaces it cannot read (their objects, leases, transfers, usage) and other users'
    connections are left out, and so is the segment name of another tenant's pool (as in
    hello); pool-wide figures and counters stay."""
    snap = statistics(b, occupancy_cells)
    access = session.access
    if access.admin:
        return snap
    can = access.can
    named = b.pages.named_to
    pools = tuple(p if named(b.pools[p.index], session) else dataclasses.replace(p, name="")
                  for p in snap.pools)
    transfer = snap.transfer
    if transfer is not None and b.fleet is not None:  # a failure's message names its keys
        transfer = dataclasses.replace(transfer, last_failure=b.fleet.last_failure(can))
    retention = snap.retention
    if retention is not None:  # another tenant's sessions are invisible, like its names
        retention = dataclasses.replace(
            retention, largest=tuple(x for x in retention.largest if can(x.namespace)))
    return dataclasses.replace(
        snap,
        retention=retention,
        pools=pools,
        transfer=transfer,
        objects=sum(1 for ns, _ in b.objects if can(ns)),
        pending=sum(1 for ns, _ in b.pending if can(ns)),
        leases=tuple(x for x in snap.leases if can(x.namespace)),
        transfers=tuple(x for x in snap.transfers if can(x.namespace)),
        clients=tuple(c for c in snap.clients if c.uid == session.uid),
        namespaces=tuple(x for x in snap.namespaces if can(x.namespace)),
    )


def _pools(b: Broker, occupancy_cells: int) -> tuple[PoolStatistics, ...]:
    per_pool = [{"read": 0, "write": 0, "objects": 0, "quarantined": 0} for _ in b.pools]
    for obj in b.objects.values():
        per_pool[obj.pool.index]["objects"] += 1
    for ls in b.leases.values():
        if ls.kind == "write":
            per_pool[ls.obj.pool.index]["write"] += ls.obj.npages
    pinned = set()  # serials of objects under a read lease (a lazy one counts no readers)
    for obj in _pinned_objects(b):
        per_pool[obj.pool.index]["read"] += obj.npages
        pinned.add(obj.serial)
    for s in b.sessions.values():
        for pool, _, npages in s.quarantine:
            per_pool[pool.index]["quarantined"] += npages
    for _, idx, _, npages, _ in b.pages.held:
        per_pool[idx]["quarantined"] += npages
    for arena in b.arenas.values():  # lent for writing, like a reservation
        per_pool[arena.pool.index]["write"] += arena.npages
    out = []
    for p, acc in zip(b.pools, per_pool):
        a, ps = p.allocator, p.page_size
        out.append(PoolStatistics(
            index=p.index, name=p.name, capacity=p.size, page_size=ps,
            used=a.used * ps, free=a.free * ps,
            leased_read=acc["read"] * ps, leased_write=acc["write"] * ps,
            quarantined=acc["quarantined"] * ps, objects=acc["objects"],
            largest_free=a.largest_free * ps, fragmentation=a.fragmentation,
            high_watermark=b.pages.high_watermark, low_watermark=b.pages.low_watermark,
            occupancy=_occupancy(b, p, occupancy_cells, pinned) if occupancy_cells else "",
        ))  # fmt: skip
    return tuple(out)


def _client(s: Session) -> ClientStatistics:
    reads = sum(1 for ls in s.leases.values() if ls.kind == "read")
    return ClientStatistics(
        session=s.id, pid=s.pid, uid=s.uid, gid=s.gid, name=s.name, role=s.role,
        connected_at=s.connected_at, read_leases=reads, write_leases=len(s.leases) - reads,
        bytes_published=s.bytes_published, bytes_claimed=s.bytes_claimed,
        reported=dict(s.reported),
    )  # fmt: skip


def _namespace_usage(b: Broker, top: int = _MAX_NAMESPACES) -> tuple[NamespaceUsage, ...]:
    """Per namespace: sealed objects, their bytes, bytes charged, quota (largest first)."""
    per: dict[str, list[int]] = {}
    for (ns, _), obj in b.objects.items():
        acc = per.setdefault(ns, [0, 0])
        acc[0] += 1
        acc[1] += obj.nbytes
    usage = b.accounts.usage
    rows = [NamespaceUsage(namespace=ns, objects=per.get(ns, (0, 0))[0],
                           bytes=per.get(ns, (0, 0))[1], used=usage.get(ns, 0),
                           quota=b.accounts.quotas.limit(ns))
            for ns in set(per) | {k for k in usage if isinstance(k, str)}]  # fmt: skip
    rows.sort(key=lambda r: (-r.used, r.namespace))
    return tuple(rows[:top])


def _pinned_objects(b: Broker) -> Iterator[StoredObject]:
    seen = set()
    for ls in b.leases.values():
        if ls.kind != "read":
            continue
        for obj in ls.objects():
            if obj.serial not in seen:
                seen.add(obj.serial)
                yield obj


def _occupancy(b: Broker, pool: HostPool, cells: int, pinned: set[int]) -> str:
    npages = pool.allocator.capacity
    cells = max(1, min(cells, npages))
    rank = {".": 0, "s": 1, "r": 2, "w": 3, "q": 4}
    out = ["."] * cells
    for start, owner in b.pages.owners[pool.index].items():
        if isinstance(owner, tuple):
            state, length = owner
        else:
            length = owner.npages
            state = "w" if not owner.sealed else ("r" if owner.serial in pinned else "s")
        first, last = start * cells // npages, (start + length - 1) * cells // npages
        for c in range(first, last + 1):
            if rank[state] > rank[out[c]]:
                out[c] = state
    return "".join(out)
