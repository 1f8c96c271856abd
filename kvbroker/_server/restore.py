"""Warm restart: the broker's state to and from the journal (:mod:`kvbroker._server.journal`).

A sealed object survives a daemon's death as a journal record; the pages it had lent for
writing come back quarantined (their writers may outlive the daemon). What that means for
who owns which page: the ownership contract in :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from itertools import count
from typing import TYPE_CHECKING, Any

from .allocator import ExtentAllocator
from .state import StoredObject

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["journal_records", "journal_lent", "restore"]


def journal_records(b: Broker) -> list[dict[str, Any]]:
    """Every sealed, linked object as a journal record, in seal order."""
    return [obj.to_record() for obj in b.objects.values()]


def journal_lent(b: Broker) -> list[tuple[int, int, int]]:
    """Every extent not free and not a sealed object's, as (pool, start, npages):
    reservations, write arenas, quarantined pages. A restart quarantines them."""
    out = [(o.pool.index, o.start, o.npages) for o in b.pending.values()]
    out += [(a.pool.index, a.start, a.npages) for a in b.arenas.values()]
    for s in b.sessions.values():
        out += [(pool.index, start, n) for pool, start, n in s.quarantine]
    out += [(idx, start, n) for _, idx, start, n, _ in b._held]
    return out


def restore(b: Broker, records: Iterable[dict[str, Any]],
            lent: Iterable[tuple[int, int, int]] = ()) -> int:  # fmt: skip
    """Adopt the sealed objects of a previous daemon (records in seal order) into an
    empty broker: the allocators are rebuilt from their extents; ``lent`` (pool, start,
    npages), the pages it had lent for writing, go into the timed quarantine (their
    writers may still be copying); everything else is free. Returns how many objects
    came back."""
    if b.objects or b.pending:
        raise RuntimeError("restore needs an empty broker")
    by_serial: dict[int, StoredObject] = {}
    live: list[list[tuple[int, int]]] = [[] for _ in b.pools]
    for rec in records:
        obj = StoredObject.from_record(rec, b.pools)
        parent = by_serial.get(rec.get("parent"))
        if parent is not None:
            obj.parent = parent
            parent.children += 1
            b._lru.pop(parent.serial, None)
        obj.linked = True
        by_serial[obj.serial] = obj
        b.objects[(obj.namespace, obj.key)] = obj
        b._owners[obj.pool.index][obj.start] = obj
        if obj.children == 0:
            b._lru[obj.serial] = obj
        live[obj.pool.index].append((obj.start, obj.npages))
        obj.charged = b.charge(obj.namespace, obj.npages * obj.pool.page_size, False)
    held = _disjoint(lent, live, [p.allocator.capacity for p in b.pools])
    deadline = b.clock() + b.restart_quarantine
    for idx, start, npages in held:
        live[idx].append((start, npages))
        b._owners[idx][start] = ("q", npages)
        heapq.heappush(b._held, (deadline, idx, start, npages, ()))
    for pool, extents in zip(b.pools, live):
        pool.allocator = ExtentAllocator.with_live(pool.allocator.capacity, extents)
    top = max(by_serial, default=0)
    b._serials = count(top + 1)
    return len(by_serial)


def _disjoint(lent: Iterable[tuple[int, int, int]], live: list[list[tuple[int, int]]],
              capacities: list[int]) -> list[tuple[int, int, int]]:  # fmt: skip
    """The ``lent`` extents (pool, start, npages) that lie inside their pool and overlap no
    ``live`` extent (per pool: (start, npages)) nor each other; a journal that says
    otherwise is wrong, and the sealed objects win."""
    taken = [sorted(ext) for ext in live]
    out = []
    for idx, start, npages in sorted(lent):
        if not (0 <= idx < len(capacities) and 0 <= start and 0 < npages
                and start + npages <= capacities[idx]):  # fmt: skip
            continue
        ext = taken[idx]
        i = bisect.bisect_left(ext, (start, 0))
        if i < len(ext) and ext[i][0] < start + npages:
            continue
        if i > 0 and ext[i - 1][0] + ext[i - 1][1] > start:
            continue
        ext.insert(i, (start, npages))
        out.append((idx, start, npages))
    return out
