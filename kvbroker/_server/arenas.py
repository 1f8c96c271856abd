"""Write arenas: pages lent to one connection to fill before naming them (``arena``,
``publish``), so a put is one round trip.

What an arena is and who frees it: the ownership contract in :mod:`kvbroker._server.state`.
:class:`Arenas` owns the live arenas and makes their transitions (lend, carve an object out
of one, end), charging through :class:`~kvbroker._server.accounts.Accounts` and allocating
through :class:`~kvbroker._server.pages.Pages`; the broker links what is carved out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PoolFull, QuotaExceeded
from .accounts import Accounts
from .leases import LeaseRegistry
from .pages import Pages
from .pool import HostPool
from .state import Arena, Session, StoredObject

__all__ = ["ArenaStatistics", "Arenas"]

# A write arena is at most this fraction of its pool, and all arenas together at most
# _ARENA_BUDGET_FRACTION of the pools: idle arenas of many clients must not hold the pool
# hostage (they are not evictable). An arena never evicts a sealed object either: it is an
# optimisation, and a client without one falls back to reserve + seal.
_ARENA_POOL_FRACTION = 16
_ARENA_BUDGET_FRACTION = 4
# Under a tenant quota, a tenant's arenas together take at most this fraction of it, and
# never what its quota has left: the objects it puts elsewhere (a namespace of another pool,
# reserve + seal) need that room, and an arena may not evict to make its own.
_ARENA_QUOTA_FRACTION = 4


@dataclass(frozen=True)
class ArenaStatistics:
    arenas: int
    pages_per_pool: dict[int, int]


class Arenas(Mapping[int, Arena]):
    """The write arenas of every session: a mapping of id -> :class:`~.state.Arena`."""

    def __init__(
        self, pools: list[HostPool], pages: Pages, accounts: Accounts, registry: LeaseRegistry
    ) -> None:
        self.pools = pools
        self._pages = pages
        self._accounts = accounts
        self._registry = registry
        self._journal: Any = None
        self._arenas: dict[int, Arena] = {}

    def __getitem__(self, aid: int) -> Arena:
        return self._arenas[aid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._arenas)

    def __len__(self) -> int:
        return len(self._arenas)

    def __contains__(self, aid: object) -> bool:
        return aid in self._arenas

    def attach_journal(self, journal: Any) -> None:
        """Journal the pages lent and returned from now on."""
        self._journal = journal

    def of(self, session: Session, aid: int) -> Arena:
        """The live arena ``aid`` of this session."""
        arena = self._arenas.get(aid)
        if arena is None:
            raise self._registry.gone(aid, "arena", fenced=False)
        if arena.session is not session:
            raise self._registry.foreign(aid, "arena")
        return arena

    def lend(self, session: Session, nbytes: int) -> Arena:
        """Owns: a fresh arena of about ``nbytes`` lent to ``session`` (charged to its
        tenants, journaled as lent). Frees: nothing (it never evicts)."""
        pages, accounts = self._pages, self._accounts
        among = pages.arena_pools(session)
        # a fraction of the pools it may land in (a tenant's own pool: of that one, however small)
        cap = max(p.size for p in among) // _ARENA_POOL_FRACTION
        nbytes = max(1, min(nbytes, cap))
        held = sum(a.npages * a.pool.page_size for a in self._arenas.values())
        budget = sum(p.size for p in self.pools) // _ARENA_BUDGET_FRACTION
        if held + nbytes > budget:
            raise PoolFull(f"write arenas already hold {held} of their {budget} bytes")
        tenants = accounts.tenants_of(session)
        ps = self.pools[0].page_size
        room = self._quota_room(tenants)
        if room is not None:
            if room < ps:  # PoolFull: the client falls back to reserve + seal, retries later
                raise PoolFull("no write arena: its tenant's quota has no room for one")
            nbytes = min(nbytes, room)
        charged = accounts.charge(None, -(-nbytes // ps) * ps, tenants=tenants)  # QuotaExceeded
        try:
            pool, start, npages = pages.allocate(nbytes, evict=False, among=among)
        except BaseException:
            accounts.uncharge(None, charged, tenants)
            raise
        arena = Arena(self._registry.next_id(), session, pool, start, npages)
        arena.charged, arena.tenants = npages * pool.page_size, tenants
        accounts.uncharge(None, charged - arena.charged, tenants)
        if self._journal is not None:
            self._journal.lent(pool.index, start, npages)
        pages.take(pool, start, ("w", npages))
        self._arenas[arena.id] = arena
        session.arenas[arena.id] = arena
        return arena

    def _quota_room(self, tenants: tuple) -> int | None:
        """The most bytes (whole pages) a new arena may take of ``tenants``' quotas; None: no
        tenant of them has a quota."""
        room = None
        accounts = self._accounts
        for account in tenants:
            limit = accounts.quotas.tenant_limit(account)
            if limit is None:
                continue
            lent = sum(a.charged for a in self._arenas.values() if account in a.tenants)
            left = min(limit // _ARENA_QUOTA_FRACTION - lent, limit - accounts.used(account))
            room = left if room is None else min(room, left)
        return None if room is None else max(0, room - room % self.pools[0].page_size)

    def end(self, arena: Arena, reason: str, hold: bool = False) -> None:
        """Frees: ``arena`` and its tenant charges; its pages go back to the pools, or with
        ``hold`` (its writer may still be copying: a cut-off connection) into the timed
        quarantine."""
        del self._arenas[arena.id]
        del arena.session.arenas[arena.id]
        charges = tuple((t, arena.charged) for t in arena.tenants)
        arena.charged = 0
        if hold:
            self._pages.hold(arena.pool, arena.start, arena.npages, charges)
        else:
            for account, n in charges:
                self._accounts.uncharge(account, n)
            self._pages.free_extent(arena.pool, arena.start, arena.npages)
            if self._journal is not None:
                self._journal.returned(arena.pool.index, arena.start)
        self._registry.ended(arena.id, reason)

    def carve(
        self, session: Session, ar: Arena, obj: StoredObject, next_arena: int
    ) -> Arena | None:
        """Owns: ``obj`` (checked, charged to its namespace) on the arena's first pages, and
        the arena now held: the rest of ``ar``, or a fresh one of ``next_arena`` bytes (0:
        none). Frees: what is left of ``ar`` when it is not kept. The caller links ``obj``."""
        pool, npages = ar.pool, obj.npages
        # The object's pages keep the arena's tenant charge (its namespace is charged apart).
        moved = min(ar.charged, npages * pool.page_size)
        ar.charged -= moved
        obj.tenants = ar.tenants
        if moved < obj.charged:
            self._accounts.charge(None, obj.charged - moved, enforce=False, tenants=obj.tenants)
        kept: Arena | None = ar
        if npages < ar.npages:
            ar.start = pool.allocator.split(ar.start, ar.npages, npages)
            ar.npages -= npages
            self._pages.take(pool, ar.start, ("w", ar.npages))
        else:
            del self._arenas[ar.id], session.arenas[ar.id]
            self._registry.ended(ar.id, "it was published whole")
            kept = None
        self._pages.take(pool, obj.start, obj)
        # Keep what is left while it is at least half the size asked for: a fresh arena
        # every few publishes amortises its allocation, and the rest is never tiny. Nor much
        # bigger than asked: a client whose arena grew for big puts asks for small ones again
        # after a run of small puts, and the rest of the big one goes back to the pool.
        wanted = min(next_arena, pool.size // _ARENA_POOL_FRACTION)
        if kept is not None:
            left = kept.npages * pool.page_size
            if 2 * left < wanted:
                self.end(kept, "it was used up; a fresh arena replaced it")
                kept = None
            elif wanted and left > 2 * wanted + pool.page_size:
                self.end(kept, "its holder asked for smaller arenas; a fresh one replaced it")
                kept = None
        if next_arena and kept is None:
            # Before the object is linked, so making room for the arena cannot evict it.
            try:
                kept = self.lend(session, next_arena)
            except (PoolFull, QuotaExceeded):
                kept = None  # the client falls back to reserve + seal
        elif not next_arena and kept is not None:
            self.end(kept, "its holder asked for no further arena")
            kept = None
        return kept

    def statistics(self) -> ArenaStatistics:
        per_pool: dict[int, int] = {}
        for a in self._arenas.values():
            per_pool[a.pool.index] = per_pool.get(a.pool.index, 0) + a.npages
        return ArenaStatistics(arenas=len(self._arenas), pages_per_pool=per_pool)
