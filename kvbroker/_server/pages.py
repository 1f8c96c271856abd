"""The broker's pages: which pool an extent goes to, what is evicted to make room for it,
and who holds each extent until the allocator has it back.

:class:`Pages` places extents (a tenant's own pool, else the shared ones, emptiest first),
allocates them (evicting least recently used objects through the broker when nothing fits,
and above the high watermark), keeps the occupancy map (the holder of each live extent: an
object, a write arena, quarantined pages) and the timed quarantine's deadlines. When each
applies — who owns and frees what, what may be evicted — is the ownership contract in
:mod:`kvbroker._server.state`. It reads what may be evicted from the
:class:`~kvbroker._server.directory.Directory` and evicts through the broker (an eviction
spans owners). No I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from .._wire.stats import PoolStatistics
from ..errors import PoolFull
from .directory import Directory
from .pool import HostPool
from .state import Session, StoredObject

__all__ = ["Pages"]


class Pages:
    """The pools' pages, as the broker hands them out and takes them back."""

    def __init__(
        self,
        pools: list[HostPool],
        directory: Directory,
        evict: Callable[[StoredObject], None],
        *,
        high_watermark: float,
        low_watermark: float,
        restart_quarantine: float,
        clock: Callable[[], float],
    ) -> None:
        if not pools:
            raise ValueError("a broker needs at least one pool")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.pools = pools
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.restart_quarantine = restart_quarantine
        self.clock = clock
        self._directory = directory  # what may be evicted, least recently used first
        self._evict = evict  # unlinks an evictable object (counted as an eviction)
        # [tier.disk] (kvbroker._server.disk_tier.DiskTier): what gives way goes there first.
        self.tier: Any = None
        # Per pool: start -> object | ("q", npages) quarantined | ("w", npages) write arena.
        self.owners: list[dict[int, Any]] = [{} for _ in pools]
        # Timed quarantine: a heap of (deadline, pool index, start, npages, charges) — pages a
        # writer may still be copying into although it lost them (daemon restart, cut off).
        self._held: list[tuple[float, int, int, int, tuple[tuple[str, int], ...]]] = []

    # ------------------------------------------------------------------ placement
    def pools_for(self, namespace: str) -> list[HostPool]:
        """The pools an object of ``namespace`` may live in: its tenant's own pool, or the
        shared ones."""
        if len(self.pools) == 1:
            return self.pools
        own = [p for p in self.pools if p.tenant is not None and p.tenant.holds(namespace)]
        return own[:1] or [p for p in self.pools if p.tenant is None]

    @staticmethod
    def named_to(pool: HostPool, session: Session) -> bool:
        """Whether ``session`` is told ``pool``'s segment (hello, stat): a shared pool, a
        tenant pool it can map (its user's, or its group's), or any pool to an admin. Another
        tenant's pool keeps its index (extents name pools by index) without name or size."""
        return (
            pool.tenant is None
            or session.access.admin
            or pool.tenant.admits(session.uid, session.access.gids)
        )

    def arena_pools(self, session: Session) -> list[HostPool]:
        """Where ``session``'s write arena goes: a tenant pool it can map, else the shared
        ones (a publish into a namespace of another pool falls back to reserve + seal)."""
        if len(self.pools) == 1:
            return self.pools
        own = [
            p
            for p in self.pools
            if p.tenant is not None and p.tenant.admits(session.uid, session.access.gids)
        ]
        return own[:1] or [p for p in self.pools if p.tenant is None]

    # ------------------------------------------------------------------ allocation
    def allocate(
        self, nbytes: int, *, evict: bool = True, among: list[HostPool] | None = None
    ) -> tuple[HostPool, int, int]:
        pools = self.pools if among is None else among
        if len(pools) == 1:  # the common case, on the hot path of every publish
            pool = pools[0]
            npages = -(-nbytes // pool.page_size)
            ok = nbytes <= pool.size and pool.lost is None
            start = pool.allocator.alloc(npages) if ok else None
            if start is not None:
                return pool, start, npages
        fits = [p for p in pools if nbytes <= p.size and p.lost is None]
        if not fits and any(p.lost for p in pools):
            raise PoolFull(
                "no usable pool: "
                + "; ".join(p.lost for p in pools if p.lost)
                + " (restart the daemon)"
            )
        if not fits:
            biggest = max(p.size for p in pools)
            raise PoolFull(f"an object of {nbytes} bytes is larger than any pool ({biggest} bytes)")
        # Emptiest pool first, which spreads objects and keeps fragmentation down.
        for pool in sorted(fits, key=lambda p: -p.allocator.free):
            npages = -(-nbytes // pool.page_size)
            start = pool.allocator.alloc(npages)
            if start is not None:
                return pool, start, npages
        if not evict:
            raise PoolFull(f"no free extent of {nbytes} bytes (not evicting for it)")
        # Evict only where it can succeed: in a pool where, with every object the eviction
        # can reach gone, a run of pages long enough would be free (a leased object in the
        # middle can leave no such run however much is evicted).
        npages_in = {p.index: -(-nbytes // p.page_size) for p in fits}
        kept = self._kept_by_eviction()
        feasible = {
            p.index for p in fits if self.room_after_eviction(p, kept) >= npages_in[p.index]
        }
        if not feasible:
            raise PoolFull(
                f"no room for {nbytes} bytes: leased or unsealed objects, write "
                "arenas or quarantined pages leave no run of pages that long, "
                "whatever is evicted"
            )
        # Each pass evicts at least one object (a parent joins the LRU once its last child
        # went), so this ends.
        # Retained objects go only when the LRU has none left there.
        directory = self._directory
        while victims := (
            [o for o in directory.evictable() if o.pool.index in feasible]
            or [o for o in directory.retained() if o.pool.index in feasible]
        ):
            for victim in victims:
                if not victim.linked or victim.readers or victim.children:
                    continue  # gone with an earlier victim (a chain's parent)
                pool = victim.pool
                directory.evicting(victim, "pool_full")
                self.give_way(victim)
                start = pool.allocator.alloc(npages_in[pool.index])
                if start is not None:
                    return pool, start, npages_in[pool.index]
        raise PoolFull(
            f"no room for {nbytes} bytes even after evicting every unleased object (fragmented)"
        )

    def _kept_by_eviction(self) -> set[int]:
        """Ids of the objects eviction cannot reach: those being written or read, and every
        object a chain of those descends from (a parent goes only after its children),
        whichever pool each lies in."""
        kept: set[int] = set()
        for owners in self.owners:
            for holder in owners.values():
                if holder.__class__ is not tuple and (holder.readers or not holder.linked):
                    obj = holder
                    while obj is not None and id(obj) not in kept:
                        kept.add(id(obj))
                        obj = obj.parent
        return kept

    def room_after_eviction(self, pool: HostPool, kept: set[int] | None = None) -> int:
        """The longest run of pages ``pool`` would have free if every object eviction can
        reach were evicted: the longest gap between what it cannot (write arenas,
        quarantined pages, the objects of ``kept``: :meth:`_kept_by_eviction`)."""
        if kept is None:
            kept = self._kept_by_eviction()
        pinned = [
            (start, holder[1] if holder.__class__ is tuple else holder.npages)
            for start, holder in self.owners[pool.index].items()
            if holder.__class__ is tuple or id(holder) in kept
        ]
        longest, at = 0, 0
        for start, npages in sorted(pinned):
            longest = max(longest, start - at)
            at = max(at, start + npages)
        return max(longest, pool.allocator.capacity - at)

    def enforce_watermark(self, pool: HostPool) -> None:
        """Above the high watermark, evict ``pool``'s least recently used objects down to
        the low one."""
        a = pool.allocator
        if a.used <= self.high_watermark * a.capacity:
            return
        target = self.low_watermark * a.capacity
        # The least recently used first, looked up again after each eviction: a chain's parent
        # joins the LRU at its oldest end when its last child goes (the chain shrinks from its
        # leaf), ahead of every younger object.
        while a.used > target:
            obj = next(self._directory.evictable(pool), None)
            if obj is None:  # the LRU has nothing left here: sessions' retained objects
                if self._back_to_lru_soon(pool):
                    break  # ... after those out of it only while their disk copy is written
                obj = next(self._directory.retained(pool), None)
                if obj is not None:
                    self._directory.evicting(obj, "watermark")
            if obj is None:
                break
            self.give_way(obj)

    def _back_to_lru_soon(self, pool: HostPool) -> bool:
        """Whether unretained objects of ``pool`` are out of the LRU only while the disk tier
        writes their copies: they come back to it when the write ends (and go to disk
        before any retained object, with no write left to make). A watermark is a target,
        not a need: it waits for them rather than take a retained object now."""
        held = () if self.tier is None else self.tier.writing_back
        keeps = self._directory.retention.keeps
        return any(
            o.pool is pool and o.linked and o.readers == 1 and not o.children and not keeps(o)
            for o in held
        )

    def give_way(self, obj: StoredObject) -> None:
        """Evict ``obj`` to make room (for an extent, under a watermark or a quota): kept on
        disk when there is a disk tier (demoted), else gone."""
        if self.tier is not None:
            self.tier.demote(obj)
        self._evict(obj)

    def take(self, pool: HostPool, start: int, holder: Any) -> None:
        """Owns: the extent at ``start`` of ``pool`` as ``holder``'s (an object; ("w",
        npages) a write arena; ("q", npages) quarantined pages). Frees: nothing."""
        self.owners[pool.index][start] = holder

    def free_extent(self, pool: HostPool, start: int, npages: int) -> None:
        """Frees: the extent at ``start`` of ``pool``, back to its allocator."""
        self.owners[pool.index].pop(start, None)
        pool.allocator.free_extent(start, npages)

    def lent_extents(self) -> list[tuple[int, int, int]]:
        """Every extent not free and not a sealed object's, as (pool, start, npages):
        reservations, write arenas, quarantined pages. A restart quarantines them."""
        out = []
        for idx, owners in enumerate(self.owners):
            for start, holder in owners.items():
                if holder.__class__ is tuple:
                    out.append((idx, start, holder[1]))
                elif not holder.sealed:
                    out.append((idx, start, holder.npages))
        return out

    # ------------------------------------------------------------------ timed quarantine
    def hold(
        self, pool: HostPool, start: int, npages: int, charges: tuple[tuple[str, int], ...] = ()
    ) -> None:
        """Owns: pages a writer may still be copying into, in the timed quarantine (used, not
        allocatable) until the deadline. Frees: nothing (``release_due`` does, later)."""
        self.owners[pool.index][start] = ("q", npages)
        deadline = self.clock() + self.restart_quarantine
        heapq.heappush(self._held, (deadline, pool.index, start, npages, charges))

    def release_due(self, now: float) -> Iterator[tuple[int, int, tuple[tuple[str, int], ...]]]:
        """Free the timed quarantine's pages whose deadline passed, earliest first; yields
        (pool index, start, charges) of each as it is freed (the caller uncharges them and
        tells the journal)."""
        held = self._held
        while held and held[0][0] <= now:
            _, idx, start, npages, charges = heapq.heappop(held)
            self.free_extent(self.pools[idx], start, npages)
            yield idx, start, charges

    # ------------------------------------------------------------------ statistics
    def usage(self) -> tuple[int, int]:
        """Bytes in use and bytes in all, over every pool (no walk over pages)."""
        used = sum(p.allocator.used * p.page_size for p in self.pools)
        return used, sum(p.size for p in self.pools)

    def statistics(
        self, occupancy_cells: int = 64, pinned: set[int] = frozenset()
    ) -> tuple[PoolStatistics, ...]:
        """Each pool as the occupancy map sees it: sealed objects, what is lent for writing
        (reservations, write arenas), quarantined pages; ``pinned``: serials of the objects
        under a read lease (the lease table's)."""
        out = []
        for pool, owners in zip(self.pools, self.owners, strict=True):
            read = write = quarantined = objects = 0
            for holder in owners.values():
                if holder.__class__ is tuple:
                    if holder[0] == "q":
                        quarantined += holder[1]
                    else:
                        write += holder[1]
                elif not holder.sealed:
                    write += holder.npages
                else:
                    objects += holder.linked
                    if holder.serial in pinned:
                        read += holder.npages
            a, ps = pool.allocator, pool.page_size
            occupancy = _occupancy(pool, owners, occupancy_cells, pinned) if occupancy_cells else ""
            out.append(
                PoolStatistics(
                    index=pool.index,
                    name=pool.name,
                    capacity=pool.size,
                    page_size=ps,
                    used=a.used * ps,
                    free=a.free * ps,
                    leased_read=read * ps,
                    leased_write=write * ps,
                    quarantined=quarantined * ps,
                    objects=objects,
                    largest_free=a.largest_free * ps,
                    fragmentation=a.fragmentation,
                    high_watermark=self.high_watermark,
                    low_watermark=self.low_watermark,
                    occupancy=occupancy,
                )
            )
        return tuple(out)


_RANK = {".": 0, "s": 1, "r": 2, "w": 3, "q": 4}


def _occupancy(pool: HostPool, owners: dict[int, Any], cells: int, pinned: set[int]) -> str:
    """One character per cell of the pool: the most telling state of a page in it
    (. free, s sealed, r read-leased, w lent for writing, q quarantined)."""
    npages = pool.allocator.capacity
    cells = max(1, min(cells, npages))
    out = ["."] * cells
    for start, owner in owners.items():
        if owner.__class__ is tuple:
            state, length = owner
        else:
            length = owner.npages
            state = "w" if not owner.sealed else ("r" if owner.serial in pinned else "s")
        first, last = start * cells // npages, (start + length - 1) * cells // npages
        for c in range(first, last + 1):
            if _RANK[state] > _RANK[out[c]]:
                out[c] = state
    return "".join(out)
