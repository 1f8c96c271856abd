"""Write arenas: pages lent to one connection to fill before naming them (``arena``,
``publish``), so a put is one round trip.

What an arena is and who frees it: the ownership contract in :mod:`kvbroker._server.state`.
These are the broker's transitions for them (lend, publish from, end); the handlers
(:mod:`kvbroker._server.handlers`) call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PoolFull, QuotaExceeded
from .state import Arena, Session, StoredObject

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["new_arena", "end_arena", "arena_of", "publish_from_arena"]

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


def new_arena(b: Broker, session: Session, nbytes: int) -> Arena:
    among = b.pages.arena_pools(session)
    # a fraction of the pools it may land in (a tenant's own pool: of that one, however small)
    cap = max(p.size for p in among) // _ARENA_POOL_FRACTION
    nbytes = max(1, min(nbytes, cap))
    held = sum(a.npages * a.pool.page_size for a in b.arenas.values())
    budget = sum(p.size for p in b.pools) // _ARENA_BUDGET_FRACTION
    if held + nbytes > budget:
        raise PoolFull(f"write arenas already hold {held} of their {budget} bytes")
    tenants = b.accounts.tenants_of(session)
    ps = b.pools[0].page_size
    room = _quota_room(b, tenants)
    if room is not None:
        if room < ps:  # PoolFull: the client falls back to reserve + seal, and retries later
            raise PoolFull("no write arena: its tenant's quota has no room for one")
        nbytes = min(nbytes, room)
    charged = b.accounts.charge(None, -(-nbytes // ps) * ps, tenants=tenants)  # QuotaExceeded
    try:
        pool, start, npages = b.pages.allocate(nbytes, evict=False, among=among)
    except BaseException:
        b.accounts.uncharge(None, charged, tenants)
        raise
    arena = Arena(b.registry.next_id(), session, pool, start, npages)
    arena.charged, arena.tenants = npages * pool.page_size, tenants
    b.accounts.uncharge(None, charged - arena.charged, tenants)
    if b.journal is not None:
        b.journal.lent(pool.index, start, npages)
    b.pages.owners[pool.index][start] = ("w", npages)
    b.arenas[arena.id] = arena
    session.arenas[arena.id] = arena
    return arena


def _quota_room(b: Broker, tenants: tuple) -> int | None:
    """The most bytes (whole pages) a new arena may take of ``tenants``' quotas; None: no
    tenant of them has a quota."""
    room = None
    for account in tenants:
        limit = b.accounts.quotas.tenant_limit(account)
        if limit is None:
            continue
        lent = sum(a.charged for a in b.arenas.values() if account in a.tenants)
        left = min(limit // _ARENA_QUOTA_FRACTION - lent,
                   limit - b.accounts.usage.get(account, 0))  # fmt: skip
        room = left if room is None else min(room, left)
    return None if room is None else max(0, room - room % b.pools[0].page_size)


def end_arena(b: Broker, arena: Arena, reason: str, hold: bool = False) -> None:
    del b.arenas[arena.id]
    del arena.session.arenas[arena.id]
    charges = tuple((t, arena.charged) for t in arena.tenants)
    arena.charged = 0
    if hold:  # its writer may still be copying (see close_session)
        b.pages.hold(arena.pool, arena.start, arena.npages, charges)
    else:
        for account, n in charges:
            b.accounts.uncharge(account, n)
        b.pages.free_extent(arena.pool, arena.start, arena.npages)
        if b.journal is not None:
            b.journal.returned(arena.pool.index, arena.start)
    b.registry.ended(arena.id, reason)


def arena_of(b: Broker, session: Session, aid: int) -> Arena:
    arena = b.arenas.get(aid)
    if arena is None:
        raise b.registry.gone(aid, "arena", fenced=False)
    if arena.session is not session:
        raise b.registry.foreign(aid, "arena")
    return arena


def publish_from_arena(b: Broker, session: Session, ar: Arena, obj: StoredObject,
                       next_arena: int) -> tuple[dict, Arena | None]:  # fmt: skip
    """Turn the arena's first pages into ``obj`` (checked, charged) and seal it; keep
    the rest as the arena, or hold a fresh one of ``next_arena`` bytes (0: none).
    Returns the seal's reply and the arena now held."""
    pool, npages = ar.pool, obj.npages
    owners = b.pages.owners[pool.index]
    # The object's pages keep the arena's tenant charge (its namespace is charged apart).
    moved = min(ar.charged, npages * pool.page_size)
    ar.charged -= moved
    obj.tenants = ar.tenants
    if moved < obj.charged:
        b.accounts.charge(None, obj.charged - moved, enforce=False, tenants=obj.tenants)
    if npages < ar.npages:
        ar.start = pool.allocator.split(ar.start, ar.npages, npages)
        ar.npages -= npages
        owners[ar.start] = ("w", ar.npages)
    else:
        del b.arenas[ar.id], session.arenas[ar.id]
        b.registry.ended(ar.id, "it was published whole")
        ar = None
    owners[obj.start] = obj
    # Keep what is left while it is at least half the size asked for: a fresh arena
    # every few publishes amortises its allocation, and the rest is never tiny. Nor much
    # bigger than asked: a client whose arena grew for big puts asks for small ones again
    # after a run of small puts, and the rest of the big one goes back to the pool.
    wanted = min(next_arena, pool.size // _ARENA_POOL_FRACTION)
    if ar is not None:
        left = ar.npages * pool.page_size
        if 2 * left < wanted:
            end_arena(b, ar, "it was used up; a fresh arena replaced it")
            ar = None
        elif wanted and left > 2 * wanted + pool.page_size:
            end_arena(b, ar, "its holder asked for smaller arenas; a fresh one replaced it")
            ar = None
    if next_arena and ar is None:
        # Before the object is linked, so making room for the arena cannot evict it.
        try:
            ar = new_arena(b, session, next_arena)
        except (PoolFull, QuotaExceeded):
            ar = None  # the client falls back to reserve + seal
    elif not next_arena and ar is not None:
        end_arena(b, ar, "its holder asked for no further arena")
        ar = None
    return b.link_sealed(session, obj), ar
