"""The broker: the transitions of the daemon's state, and the dispatch of requests.

What the state is, and who owns and frees what, is written once: see
:mod:`kvbroker._server.state`. :class:`Broker` makes the changes — sessions opened and
closed, leases lent, renewed, expired and ended, objects sealed and unlinked, extents
allocated, evicted (LRU, watermarks), quarantined and freed, namespace quotas charged, the
journal told (write arenas: :mod:`~kvbroker._server.arenas`; warm restart:
:mod:`~kvbroker._server.restore`) — and routes each request to its op's handler, derived
from the op table (``kvbroker._wire.protocol.OPS``: the ``service`` column). No I/O, no
asyncio.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import fields
from itertools import count
from typing import Any

from .arenas import end_arena
from .handlers import HANDLERS
from .leases import LeaseRegistry
from .policy import Policy, Quotas, forget_accounts, user_name
from .pool import HostPool
from .restore import journal_lent, journal_records, restore as restore_state
from .snapshot import statistics
from .state import OPEN_POLICY, Arena, Lease, Session, StoredObject, WouldWait
from .._wire.protocol import OPS, Service, validate_args
from .._wire.stats import Counters, Statistics
from ..errors import BadRequest, LimitExceeded, PoolFull, ProtocolError, QuotaExceeded

__all__ = ["Broker", "Session", "WouldWait"]

# The broker's own rows of the op table, each with its handler: a row without one fails here.
_HANDLERS = {name: HANDLERS[name] for name, op in OPS.items() if op.service is Service.BROKER}

class Broker:
    """Owns the directory of objects and every lease; the daemon drives it."""

    def __init__(
        self,
        pools: list[HostPool],
        *,
        lease_ttl: float = 30.0,
        max_lease_ttl: float = 3600.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        socket_path: str = "",
        clock: Callable[[], float] = time.monotonic,
        require_checksums: bool = False,
        policy: Policy | None = None,
        quotas: Quotas | None = None,
        max_leases_per_client: int = 65536,
        restart_quarantine: float = 10.0,
    ) -> None:
        if not pools:
            raise ValueError("a broker needs at least one pool")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.pools = pools
        self.lease_ttl = lease_ttl
        self.max_lease_ttl = max_lease_ttl
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.socket_path = socket_path
        self.clock = clock
        self.require_checksums = require_checksums  # seal without {buffer: digest} refused
        self.policy = policy or OPEN_POLICY  # who may use which namespace (policy.py)
        self.quotas = quotas or Quotas()
        self.max_leases_per_client = max_leases_per_client
        # Timed quarantine: a heap of (deadline, pool index, start, npages, charges) — pages a
        # writer may still be copying into although it lost them (daemon restart, cut off).
        self.restart_quarantine = restart_quarantine
        self._held: list[tuple[float, int, int, int, tuple[tuple[str, int], ...]]] = []
        # namespace (or tenant account, ("user", uid) / ("group", gid)) -> bytes charged
        self._usage: dict[Any, int] = {}
        self.started_at = time.time()
        self.sessions: dict[int, Session] = {}
        self.objects: dict[tuple[str, str], StoredObject] = {}
        # The same objects by namespace (key -> object, seal order): list, evict and quotas
        # of one namespace cost what that namespace holds, not what the daemon holds.
        self.by_namespace: dict[str, dict[str, StoredObject]] = {}
        self.pending: dict[tuple[str, str], StoredObject] = {}
        self.leases: dict[int, Lease] = {}
        self.arenas: dict[int, Arena] = {}  # write arenas of every session, by id
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()  # sealed, linked, unleased
        self._owners: list[dict[int, Any]] = [{} for _ in pools]  # start -> object | ("q", n)
        self._expiry: list[tuple[float, int]] = []
        self.registry = LeaseRegistry()  # ids of sessions, leases, arenas, ring leases
        self.journal: Any = None  # kvbroker._server.journal.Journal, when the daemon keeps one
        self._serials = count(1)
        self._link_seq = count(1)  # StoredObject.seq: Broker.objects' iteration order
        self.counters: dict[str, int] = {f.name: 0 for f in fields(Counters)}
        # (at, op, session, namespace, key, nbytes) of the latest publishes and claims
        self.transfers: deque[tuple] = deque(maxlen=64)
        # Called with (namespace, key) after each seal; the daemon wakes waiting claims.
        self.on_sealed: Callable[[tuple[str, str]], None] | None = None
        # Called with ("stored", obj) after a prefix block (one with token ids) is sealed,
        # ("removed", obj) when it is unlinked, ("cleared", None) when everything was
        # evicted: the daemon turns these into KV events (kvbroker._server.events).
        self.on_block: Callable[[str, StoredObject | None], None] | None = None
        # Broker-to-broker pulls and serving (kvbroker._server.fleet.Fleet), when configured.
        self.fleet: Any = None
        self._rings: Any = None

    @property
    def rings(self) -> Any:
        """GPU staging rings (kvbroker._server.rings.RingService) with --gpu-ring, or None."""
        return self._rings

    @rings.setter
    def rings(self, rings: Any) -> None:
        if rings is not None:
            assert not rings.leases, "attach the rings before they lend anything"
            rings.registry = self.registry  # one id space and one set of lease rules
        self._rings = rings

    @property
    def epoch(self) -> int:
        return self.registry.epoch

    # ------------------------------------------------------------------ requests
    def handle(self, session: Session, op: str, raw_args: Any, daemon: Any = None) -> Any:
        """Run one request; returns its result or raises a KVBrokerError (or WouldWait).
        ``daemon``: what answers the ops the table gives the daemon (the connection)."""
        self.counters["requests"] += 1
        args = validate_args(op, raw_args)
        row = OPS[op]
        if row.needs_hello and not session.greeted:
            raise ProtocolError("the first request on a connection must be hello")
        handler = _HANDLERS.get(op)
        if handler is not None:
            if self.journal is None:
                return handler(self, session, **args)
            with self.journal.batch():  # one write for every record of this request
                return handler(self, session, **args)
        if row.service is Service.RINGS:
            if self.rings is None:
                raise BadRequest(f"{op}: this daemon has no GPU rings (serve --gpu-ring SIZE)")
            return self.rings.handle(session, op, args)
        if daemon is None:
            raise BadRequest(f"{op}: only a daemon's connection answers it")
        return daemon.handle(session, op, args)

    def statistics(self, occupancy_cells: int = 64) -> Statistics:
        return statistics(self, occupancy_cells)

    def snapshot(self, occupancy_cells: int = 64) -> dict[str, Any]:
        """The statistics as sent on the wire (``Statistics.to_dict``)."""
        return self.statistics(occupancy_cells).to_dict()

    # ------------------------------------------------------------------ warm restart
    def attach_journal(self, journal: Any, next_id: int) -> None:
        """Journal every change of the index from now on; ids continue from ``next_id``."""
        self.journal = journal
        self.registry.attach(journal, next_id)
        journal.rewrite(journal_records(self), next_id, journal_lent(self))
        self.registry.fenced_up_to(journal.id_limit)

    def compact_journal(self) -> None:
        """Rewrite the journal as the live objects only (the daemon calls this off the
        request path, when the log has grown to twice what is live)."""
        self.journal.rewrite(journal_records(self), self.registry.take_next(),
                             journal_lent(self))  # fmt: skip
        self.registry.fenced_up_to(self.journal.id_limit)

    def journal_lent(self) -> list[tuple[int, int, int]]:
        return journal_lent(self)

    def restore(self, records: Iterable[dict[str, Any]],
                lent: Iterable[tuple[int, int, int]] = (), **checks: Any) -> int:  # fmt: skip
        """Adopt the sealed objects of a previous daemon (kvbroker._server.restore; ``checks``:
        its ``report``, ``dropped`` and ``verify``)."""
        n = restore_state(self, records, lent, **checks)
        for obj in self.objects.values():  # the link order they were restored in
            obj.seq = next(self._link_seq)
        return n

    # ------------------------------------------------------------------ sessions
    def open_session(self, pid: int = 0, uid: int = -1, gid: int = -1) -> Session:
        s = Session(self.registry.next_id(), pid, uid, gid)
        s.access = self.policy.access(uid, gid)
        self.sessions[s.id] = s
        return s

    def set_policy(self, policy: Policy, quotas: Quotas) -> None:
        """A reload: new rules apply to every connection from its next request on, with
        user names and group membership read again (a user removed from a group loses
        what the group gave it)."""
        forget_accounts()
        self.policy, self.quotas = policy, quotas
        for s in self.sessions.values():
            s.access = policy.access(s.uid, s.gid)

    def close_session(self, session: Session, cut_off: bool = False) -> None:
        """A connection ended: its leases end. When the client closed it, its writer is gone
        and its write-leased pages and quarantine are freed now. When the daemon cut it off
        (``cut_off``: a peer not reading, a protocol error, a stop), its process may still
        be copying: those pages go into the timed quarantine instead."""
        for lease in list(session.leases.values()):
            if lease.kind == "write":
                self.discard_pending(lease, quarantine=cut_off)
                self.end_lease(lease, "its connection closed")
            else:
                self.end_read(lease, "its connection closed", consume=False)
        for arena in list(session.arenas.values()):
            end_arena(self, arena, "its connection closed", hold=cut_off)
        charges = tuple(session.quarantine_charges)
        for pool, start, npages in session.quarantine:
            if cut_off:
                self.hold(pool, start, npages, charges)
                charges = ()  # uncharged with the first extent (they share a deadline)
            else:
                self.free_extent(pool, start, npages)
                if self.journal is not None:
                    self.journal.returned(pool.index, start)
        session.quarantine.clear()
        for namespace, charged in charges:
            self.uncharge(namespace, charged)
        session.quarantine_charges.clear()
        if self.rings is not None:
            self.rings.close_session(session)
        self.sessions.pop(session.id, None)

    def end_unpublished(self, session: Session, args: Any, reason: str) -> None:
        """End the write leases and the arena a refused publishing request names (``lease``,
        ``leases``, ``arena``) that are this session's, freeing their pages: a stopping
        daemon that frees its pools refuses to publish them (see ``Drain.publishes``)."""
        if not isinstance(args, dict):
            return
        named = [args.get("lease"), args.get("arena")]
        if isinstance(args.get("leases"), list):
            named += args["leases"]
        for lid in named:
            if not isinstance(lid, int) or isinstance(lid, bool):
                continue
            ls = self.leases.get(lid)
            if ls is not None and ls.session is session and ls.kind == "write":
                self.discard_pending(ls, quarantine=False)
                self.end_lease(ls, reason)
            arena = self.arenas.get(lid)
            if arena is not None and arena.session is session:
                end_arena(self, arena, reason)

    # ------------------------------------------------------------------ write leases
    def new_object(self, ident: tuple[str, str], pool: HostPool, start: int, npages: int,
                   layout: dict[str, tuple[int, int]], meta: dict | None) -> StoredObject:  # fmt: skip
        """An unsealed object on ``npages`` pages of ``pool`` from ``start``, its buffers
        at the ``layout`` offsets (relative to the extent)."""
        base = start * pool.page_size
        return StoredObject(
            ident[0], ident[1], pool, start, npages, sum(n for _, n in layout.values()),
            {name: (base + off, n) for name, (off, n) in layout.items()}, meta,
            next(self._serials),
        )  # fmt: skip

    def reserve_extent(self, session, ident, layout, span, meta, ttl) -> Lease:
        """A write lease on a fresh extent for ``ident`` (charged to its namespace)."""
        self.check_lease_limit(session)
        ps = self.pools[0].page_size  # every pool has the same page size
        tenants = self.tenants_of(session)
        charged = self.charge(ident[0], -(-max(span, 1) // ps) * ps, tenants=tenants)
        try:
            pool, start, npages = self.allocate(max(span, 1), among=self.pools_for(ident[0]))
        except BaseException:
            self.uncharge(ident[0], charged, tenants)
            raise
        obj = self.new_object(ident, pool, start, npages, layout, meta)
        obj.charged, obj.tenants = charged, tenants
        self._owners[pool.index][start] = obj
        self.pending[ident] = obj
        if self.journal is not None:  # a restart must not hand these pages to another writer
            self.journal.lent(pool.index, start, npages)
        return self.new_lease("write", session, obj, ttl)

    def seal(self, ls: Lease) -> dict:
        """End a write lease by making its object visible."""
        obj = ls.obj
        del self.pending[(obj.namespace, obj.key)]
        self.end_lease(ls, "it was sealed")
        return self.link_sealed(ls.session, obj)

    def link_sealed(self, session: Session, obj: StoredObject) -> dict:
        """Make a fully written object visible (replacing an older one of its key)."""
        ident = (obj.namespace, obj.key)
        old = self.objects.get(ident)
        if old is not None:
            self._unlink(old)
        obj.sealed = True
        obj.linked = True
        obj.last_access = time.time()
        obj.seq = next(self._link_seq)
        self.index(obj)
        self._lru[obj.serial] = obj
        if obj.parent_key is not None:
            # An absent parent (evicted while we wrote) leaves nothing to keep whole.
            parent = self.objects.get((obj.namespace, obj.parent_key))
            if parent is not None and parent is not obj:
                obj.parent = parent
                parent.children += 1
                self._lru.pop(parent.serial, None)  # a parent goes only after its children
        if self.journal is not None:  # before the reply: a sealed object survives a crash
            self.journal.sealed(obj.to_record())
        self.counters["publishes"] += 1
        self.counters["bytes_in"] += obj.nbytes
        session.bytes_published += obj.nbytes
        self.record_transfer("publish", session, obj, obj.nbytes)
        if self.on_block is not None and obj.tokens is not None:
            self.on_block("stored", obj)
        self._enforce_watermark(obj.pool)
        if self.on_sealed is not None:
            self.on_sealed(ident)
        return {"namespace": obj.namespace, "key": obj.key, "nbytes": obj.nbytes}

    def index(self, obj: StoredObject) -> None:
        """Make ``obj`` the object of its key (the caller unlinked any older one)."""
        self.objects[(obj.namespace, obj.key)] = obj
        space = self.by_namespace.setdefault(obj.namespace, {})
        space.pop(obj.key, None)  # seal order: a replacement goes last
        space[obj.key] = obj

    def in_namespace(self, namespace: str | None) -> Iterable[StoredObject]:
        """The sealed objects of ``namespace`` (None: all), in seal order."""
        if namespace is None:
            return self.objects.values()
        return self.by_namespace.get(namespace, {}).values()

    def discard_pending(self, ls: Lease, quarantine: bool) -> None:
        obj = ls.obj
        del self.pending[(obj.namespace, obj.key)]
        if quarantine:
            # The pages stay charged to the namespace until the writer's connection ends.
            ls.session.quarantine_charges.append((obj.namespace, obj.charged))
            ls.session.quarantine_charges += [(t, obj.charged) for t in obj.tenants]
            obj.charged = 0
            self._owners[obj.pool.index][obj.start] = ("q", obj.npages)
            ls.session.quarantine.append((obj.pool, obj.start, obj.npages))
        else:
            self._free_object(obj)

    # ------------------------------------------------------------------ leases
    def new_lease(self, kind, session, obj, ttl, consume=False) -> Lease:
        ls = Lease(self.registry.next_id(), kind, session, obj, ttl, self.clock() + ttl,
                   consume)  # fmt: skip
        self.leases[ls.id] = ls
        session.leases[ls.id] = ls
        heapq.heappush(self._expiry, (ls.expires_at, ls.id))
        return ls

    def lease_of(self, session: Session, lid: int, kind: str | None) -> Lease:
        """The live lease ``lid`` of this session (of ``kind``, unless None)."""
        ls = self.leases.get(lid)
        if ls is None:
            raise self.registry.gone(lid)
        if ls.session is not session:
            raise self.registry.foreign(lid)
        if kind is not None and ls.kind != kind:
            raise BadRequest(f"lease {lid} is a {ls.kind} lease, not a {kind} lease")
        return ls

    def renew(self, ls: Lease, ttl: float) -> None:
        ls.ttl = ttl
        ls.expires_at = self.clock() + ttl
        heapq.heappush(self._expiry, (ls.expires_at, ls.id))

    def end_lease(self, ls: Lease, reason: str) -> None:
        del self.leases[ls.id]
        ls.session.leases.pop(ls.id, None)
        self.registry.ended(ls.id, reason)

    def end_read(self, ls: Lease, reason: str, consume: bool) -> None:
        self.end_lease(ls, reason)
        for obj in reversed(ls.objects()):  # leaves first, for chains
            obj.readers -= 1
            if consume and obj.linked:
                obj.consumers -= 1
                if self.journal is not None and obj.consumers > 0:
                    self.journal.consumers(obj.serial, obj.consumers)
            if consume and obj.linked and obj.consumers <= 0:
                self._unlink(obj)  # frees now, or when the last other reader leaves
            elif obj.linked:
                if obj.readers == 0 and obj.children == 0:
                    self._lru[obj.serial] = obj  # most recently used
            elif obj.readers == 0:
                self._free_object(obj)  # unlinked earlier; the last reader just left

    def pin(self, obj: StoredObject, now: float | None = None) -> None:
        """One more reader: neither evicted nor reused until it leaves."""
        obj.readers += 1
        obj.last_access = time.time() if now is None else now
        self._lru.pop(obj.serial, None)

    def pin_prefix(self, found: list[StoredObject]) -> tuple[tuple[str, ...], list | None, int]:
        """Pin every block of a prefix match (as :meth:`pin`, inline: this loop runs per
        block); returns the first block's buffer names, each block's packed extent row
        (None when the blocks differ in names), and the bytes pinned."""
        now = time.time()
        lru_pop = self._lru.pop
        names = found[0].compact_extents()[0]
        rows: list | None = []
        nbytes = 0
        for obj in found:
            obj.readers += 1
            obj.last_access = now
            lru_pop(obj.serial, None)
            shape, row = obj.extents or obj.compact_extents()
            if shape != names:
                rows = None
            elif rows is not None:
                rows.append(row)
            nbytes += obj.nbytes
        return names, rows, nbytes

    def check_lease_limit(self, session: Session) -> None:
        if len(session.leases) >= self.max_leases_per_client:
            raise LimitExceeded(
                f"session {session.id} ({session.name or 'pid ' + str(session.pid)}) holds "
                f"{len(session.leases)} leases, the most one connection may hold "
                "(max_leases_per_client): release some first"
            )

    def expire(self, now: float | None = None) -> int:
        """End every lease whose TTL passed, and free the timed quarantine whose deadline
        passed; returns how many leases ended."""
        now = self.clock() if now is None else now
        held = self._held
        while held and held[0][0] <= now:
            _, idx, start, npages, charges = heapq.heappop(held)
            self.free_extent(self.pools[idx], start, npages)
            for namespace, charged in charges:
                self.uncharge(namespace, charged)
            if self.journal is not None:
                self.journal.returned(idx, start)
        ended = 0
        while self._expiry and self._expiry[0][0] <= now:
            at, lid = heapq.heappop(self._expiry)
            ls = self.leases.get(lid)
            if ls is None or ls.expires_at != at:
                continue  # released, or renewed (a later heap entry stands for it)
            reason = f"its {ls.ttl:g} s TTL passed without renewal"
            if ls.kind == "write":
                self.discard_pending(ls, quarantine=True)
                self.end_lease(ls, reason)
            else:
                self.end_read(ls, reason, consume=False)
            self.counters["expired_leases"] += 1
            ended += 1
        return ended

    # ------------------------------------------------------------------ pages
    def evict(self, obj: StoredObject) -> None:
        assert obj.readers == 0 and obj.sealed and obj.children == 0
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += obj.nbytes
        self._unlink(obj)

    def tenants_of(self, session: Session) -> tuple[tuple[str, int], ...]:
        """The tenant accounts ``session``'s writes are charged to (none without tenant
        quotas)."""
        return self.quotas.tenants(session.uid, session.access.gids) if self.quotas else ()

    def charge(self, namespace: str | None, nbytes: int, enforce: bool = True,
               tenants: tuple[tuple[str, int], ...] = ()) -> int:  # fmt: skip
        """Count ``nbytes`` against ``namespace`` (None: none) and each tenant account; over
        a quota, evict that namespace's (or tenant's) own least recently used unleased
        objects first, then raise QuotaExceeded (charging nothing). Returns the bytes
        charged (the caller stores them on the object, freeing uncharges them)."""
        accounts = ([namespace] if namespace is not None else []) + list(tenants)
        if enforce and self.quotas:
            for account in accounts:
                self._make_room(account, nbytes)
        for account in accounts:
            self._usage[account] = self._usage.get(account, 0) + nbytes
        return nbytes

    def _make_room(self, account: Any, nbytes: int) -> None:
        if isinstance(account, tuple):
            limit = self.quotas.tenant_limit(account)
            kind, ident = account
            what = f"{kind} {user_name(ident) if kind == 'user' else ident}"

            def owned(o: StoredObject) -> bool:
                return account in o.tenants
        else:
            limit = self.quotas.limit(account)
            what = f"namespace {account!r}"

            def owned(o: StoredObject) -> bool:
                return o.namespace == account
        used = self._usage.get(account, 0)
        if limit is None or used + nbytes <= limit:
            return
        mine = [o for o in self._lru.values() if owned(o)]
        evictable = sum(o.charged for o in mine)
        if used - evictable + nbytes > limit:
            raise QuotaExceeded(
                f"{what}: {nbytes} more bytes would make {used + nbytes} of its quota of "
                f"{limit} ({used} used, {evictable} of them evictable); free some (release "
                "leases, evict, abort write arenas) or raise [quotas]"
            )
        for obj in mine:
            if self._usage.get(account, 0) + nbytes <= limit:
                break
            self.evict(obj)

    def uncharge(self, namespace: Any, nbytes: int,
                 tenants: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        for account in ([namespace] if namespace is not None else []) + list(tenants):
            left = self._usage.get(account, 0) - nbytes
            if left > 0:
                self._usage[account] = left
            else:
                self._usage.pop(account, None)

    def record_transfer(self, op: str, session: Session, obj: StoredObject, nbytes: int) -> None:
        self.transfers.append((time.time(), op, session.id, obj.namespace, obj.key, nbytes))

    def _unlink(self, obj: StoredObject) -> None:
        """Make an object unreachable; its extents go once no reader holds them."""
        if not obj.linked:
            return
        obj.linked = False
        if self.journal is not None:
            self.journal.unlinked(obj.serial)
        del self.objects[(obj.namespace, obj.key)]
        space = self.by_namespace[obj.namespace]
        del space[obj.key]
        if not space:
            del self.by_namespace[obj.namespace]
        self._lru.pop(obj.serial, None)
        if self.on_block is not None and obj.tokens is not None:
            self.on_block("removed", obj)
        parent, obj.parent = obj.parent, None
        if parent is not None and parent.linked:
            parent.children -= 1
            if parent.children == 0 and parent.readers == 0:
                # Oldest end: the chain keeps shrinking from its leaf under pressure.
                self._lru[parent.serial] = parent
                self._lru.move_to_end(parent.serial, last=False)
        if obj.readers == 0:
            self._free_object(obj)

    def _free_object(self, obj: StoredObject) -> None:
        self._owners[obj.pool.index].pop(obj.start, None)
        obj.pool.allocator.free_extent(obj.start, obj.npages)
        if not obj.sealed and self.journal is not None:  # a reservation's pages came back
            self.journal.returned(obj.pool.index, obj.start)
        if obj.charged:
            self.uncharge(obj.namespace, obj.charged, obj.tenants)
            obj.charged = 0

    def hold(self, pool: HostPool, start: int, npages: int,
              charges: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        """Put pages a writer may still be copying into in the timed quarantine: used, not
        allocatable, freed (and ``charges`` uncharged) by ``expire`` after the deadline."""
        self._owners[pool.index][start] = ("q", npages)
        deadline = self.clock() + self.restart_quarantine
        heapq.heappush(self._held, (deadline, pool.index, start, npages, charges))

    def free_extent(self, pool: HostPool, start: int, npages: int) -> None:
        self._owners[pool.index].pop(start, None)
        pool.allocator.free_extent(start, npages)

    def pools_for(self, namespace: str) -> list[HostPool]:
        """The pools an object of ``namespace`` may live in: its tenant's own pool, or the
        shared ones."""
        if len(self.pools) == 1:
            return self.pools
        own = [p for p in self.pools if p.tenant is not None and p.tenant.holds(namespace)]
        return own[:1] or [p for p in self.pools if p.tenant is None]

    def arena_pools(self, session: Session) -> list[HostPool]:
        """Where ``session``'s write arena goes: a tenant pool it can map, else the shared
        ones (a publish into a namespace of another pool falls back to reserve + seal)."""
        if len(self.pools) == 1:
            return self.pools
        own = [p for p in self.pools if p.tenant is not None
               and p.tenant.admits(session.uid, session.access.gids)]  # fmt: skip
        return own[:1] or [p for p in self.pools if p.tenant is None]

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
        # Evict only if it can succeed: free + evictable pages must cover the request.
        evictable = {p.index: p.allocator.free for p in fits}
        for obj in self._lru.values():
            if obj.pool.index in evictable:
                evictable[obj.pool.index] += obj.npages
        feasible = {
            p.index for p in fits if evictable[p.index] >= -(-nbytes // p.page_size)
        }
        if not feasible:
            raise PoolFull(
                f"no room for {nbytes} bytes: the pools are held by leased or unsealed objects"
            )
        # Bounded: each victim is tried once (a loop until something fits could spin for ever
        # if an eviction freed nothing, e.g. over an inconsistent index).
        npages_in = {p.index: -(-nbytes // p.page_size) for p in fits}
        for victim in [o for o in self._lru.values() if o.pool.index in feasible]:
            if victim.serial not in self._lru:
                continue  # gone with an earlier victim (a chain's parent)
            pool = victim.pool
            self.evict(victim)
            start = pool.allocator.alloc(npages_in[pool.index])
            if start is not None:
                return pool, start, npages_in[pool.index]
        raise PoolFull(f"no room for {nbytes} bytes even after evicting every unleased "
                       "object (fragmented)")

    def _enforce_watermark(self, pool: HostPool) -> None:
        a = pool.allocator
        if a.used <= self.high_watermark * a.capacity:
            return
        target = self.low_watermark * a.capacity
        for obj in [o for o in self._lru.values() if o.pool is pool]:
            if a.used <= target:
                break
            self.evict(obj)
