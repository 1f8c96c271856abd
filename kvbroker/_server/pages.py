"""The broker's pages: which pool an extent goes to, what is evicted to make room for it,
and who holds each extent until the allocator has it back.

:class:`Pages` places extents (a tenant's own pool, else the shared ones, emptiest first),
allocates them (evicting least recently used objects through the broker when nothing fits,
and above the high watermark), keeps the occupancy map (the holder of each live extent: an
object, a write arena, quarantined pages) and the timed quarantine's deadlines. When each
applies — who owns and frees what, what may be evicted — is the ownership contract in
:mod:`kvbroker._server.state`. :class:`~kvbroker._server.broker.Broker` composes it and
shares its LRU with it. No I/O.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import PoolFull
from .pool import HostPool

if TYPE_CHECKING:
    from .retention import Retention
    from .state import Session, StoredObject

__all__ = ["Pages"]


class Pages:
    """The pools' pages, as the broker hands them out and takes them back."""

    def __init__(
        self,
        pools: list[HostPool],
        lru: OrderedDict[int, StoredObject],
        evict: Callable[[StoredObject], None],
        *,
        high_watermark: float,
        low_watermark: float,
        restart_quarantine: float,
        clock: Callable[[], float],
        retention: Retention | None = None,
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
        # sealed, linked, unleased objects, least recently used first (the broker's)
        self._lru = lru
        self._evict = evict  # unlinks an evictable object (counted as an eviction)
        # Sessions' retained objects (kvbroker._server.retention): evicted only once nothing
        # of the LRU is left, in their own order, each eviction told why.
        self._retention = retention
        # Per pool: start -> object | ("q", npages) quarantined | ("w", npages) write arena.
        self.owners: list[dict[int, Any]] = [{} for _ in pools]
        # Timed quarantine: a heap of (deadline, pool index, start, npages, charges) — pages a
        # writer may still be copying into although it lost them (daemon restart, cut off).
        self.held: list[tuple[float, int, int, int, tuple[tuple[str, int], ...]]] = []

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
        return (pool.tenant is None or session.access.admin
                or pool.tenant.admits(session.uid, session.access.gids))  # fmt: skip

    def arena_pools(self, session: Session) -> list[HostPool]:
        """Where ``session``'s write arena goes: a tenant pool it can map, else the shared
        ones (a publish into a namespace of another pool falls back to reserve + seal)."""
        if len(self.pools) == 1:
            return self.pools
        own = [p for p in self.pools if p.tenant is not None
               and p.tenant.admits(session.uid, session.access.gids)]  # fmt: skip
        return own[:1] or [p for p in self.pools if p.tenant is None]

    # ------------------------------------------------------------------ allocation
    def allocate(self, nbytes: int, *, evict: bool = True,
                 among: list[HostPool] | None = None) -> tuple[HostPool, int, int]:  # fmt: skip
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
            raise PoolFull("no usable pool: " + "; ".join(p.lost for p in pools if p.lost)
                           + " (restart the daemon)")
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
        feasible = {p.index for p in fits
                    if self.room_after_eviction(p, kept) >= npages_in[p.index]}  # fmt: skip
        if not feasible:
            raise PoolFull(f"no room for {nbytes} bytes: leased or unsealed objects, write "
                           "arenas or quarantined pages leave no run of pages that long, "
                           "whatever is evicted")  # fmt: skip
        # Each pass evicts at least one object (a parent joins the LRU once its last child
        # went), so this ends. Retained objects go only when the LRU has none left there.
        while victims := ([o for o in self._lru.values() if o.pool.index in feasible]
                          or [o for o in self._retained() if o.pool.index in feasible]):
            for victim in victims:
                if not victim.linked or victim.readers or victim.children:
                    continue  # gone with an earlier victim (a chain's parent)
                pool = victim.pool
                if self._retention is not None:
                    self._retention.evicted_now(victim, "pool_full")
                self._evict(victim)
                start = pool.allocator.alloc(npages_in[pool.index])
                if start is not None:
                    return pool, start, npages_in[pool.index]
        raise PoolFull(f"no room for {nbytes} bytes even after evicting every unleased "
                       "object (fragmented)")

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
        pinned = [(start, holder[1] if holder.__class__ is tuple else holder.npages)
                  for start, holder in self.owners[pool.index].items()
                  if holder.__class__ is tuple or id(holder) in kept]  # fmt: skip
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
            obj = next((o for o in self._lru.values() if o.pool is pool), None)
            if obj is None:  # the LRU has nothing left here: sessions' retained objects
                obj = next((o for o in self._retained() if o.pool is pool), None)
                if obj is not None:
                    self._retention.evicted_now(obj, "watermark")  # type: ignore[union-attr]
            if obj is None:
                break
            self._evict(obj)

    def _retained(self) -> Iterator[StoredObject]:
        return self._retention.victims() if self._retention is not None else iter(())

    def free_extent(self, pool: HostPool, start: int, npages: int) -> None:
        self.owners[pool.index].pop(start, None)
        pool.allocator.free_extent(start, npages)

    # ------------------------------------------------------------------ timed quarantine
    def hold(self, pool: HostPool, start: int, npages: int,
             charges: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        """Put pages a writer may still be copying into in the timed quarantine: used, not
        allocatable, freed (and ``charges`` uncharged) by ``expire`` after the deadline."""
        self.owners[pool.index][start] = ("q", npages)
        deadline = self.clock() + self.restart_quarantine
        heapq.heappush(self.held, (deadline, pool.index, start, npages, charges))

    def release_due(self, now: float) -> Iterator[tuple[int, int, tuple[tuple[str, int], ...]]]:
        """Free the timed quarantine's pages whose deadline passed, earliest first; yields
        (pool index, start, charges) of each as it is freed (the caller uncharges them and
        tells the journal)."""
        held = self.held
        while held and held[0][0] <= now:
            _, idx, start, npages, charges = heapq.heappop(held)
            self.free_extent(self.pools[idx], start, npages)
            yield idx, start, charges
