"""The broker: the transitions of the daemon's state, and the dispatch of requests.

What the state is, and who owns and frees what, is written once: see
:mod:`kvbroker._server.state`. :class:`Broker` makes the changes — sessions opened and
closed, leases lent, renewed, expired and ended, objects sealed, unlinked and evicted (the
LRU), the journal told — and routes each request to its op's handler, derived from the op
table (``kvbroker._wire.protocol.OPS``: the ``service`` column). Its parts, one concept
each: where extents go, what gives way for them, the occupancy map and the timed quarantine
(:mod:`~kvbroker._server.pages`), quota charges (:mod:`~kvbroker._server.accounts`), write
arenas (:mod:`~kvbroker._server.arenas`), sessions' retention and the order retained objects
are evicted in (:mod:`~kvbroker._server.retention`), warm restart
(:mod:`~kvbroker._server.restore`).
No I/O, no asyncio.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import fields
from itertools import count
from typing import Any

from .accounts import Accounts
from .arenas import end_arena
from .handlers import HANDLERS
from .leases import LeaseRegistry
from .pages import Pages
from .policy import Policy, Quotas, forget_accounts
from .pool import HostPool
from .prefix_leases import materialize, materialize_holding
from .restore import journal_lent, journal_records, restore as restore_state
from .retention import Retention, RetentionSettings
from .snapshot import statistics
from .state import OPEN_POLICY, Arena, Lease, Session, StoredObject, WouldWait, index_footprint
from .._wire.protocol import OPS, Service, validate_args
from .._wire.stats import Counters, Statistics
from ..errors import BadRequest, LimitExceeded, ProtocolError

__all__ = ["Broker", "Session", "WouldWait"]

# The broker's own rows of the op table, each with its handler: a row without one fails here.
_HANDLERS = {name: HANDLERS[name] for name, op in OPS.items() if op.service is Service.BROKER}


class _Part:
    """An attribute of the broker that one of its parts keeps: reading and setting it on the
    broker reads and sets the part's (a reload sets the broker's settings by name)."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, broker: Any, owner: Any = None) -> Any:
        return self if broker is None else getattr(getattr(broker, self.part), self.name)

    def __set__(self, broker: Any, value: Any) -> None:
        setattr(getattr(broker, self.part), self.name, value)


class Broker:
    """Owns the directory of objects and every lease; the daemon drives it."""

    # Kept by its parts (pages.py, accounts.py), read and set here under the names they had
    # before the parts were split off: a reload sets settings by name, tests read the tables.
    high_watermark = _Part("pages", "high_watermark")
    low_watermark = _Part("pages", "low_watermark")
    restart_quarantine = _Part("pages", "restart_quarantine")
    quotas = _Part("accounts", "quotas")
    _owners = _Part("pages", "owners")  # pool -> start -> holder (the occupancy map)
    _held = _Part("pages", "held")  # the timed quarantine's heap
    _usage = _Part("accounts", "usage")  # account -> bytes charged

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
        max_leases_per_uid: int = 262144,
        restart_quarantine: float = 10.0,
        retention: RetentionSettings | None = None,
    ) -> None:
        self.clock = clock  # the leases' TTLs, and the timed quarantine's deadlines
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()  # sealed, linked, unleased
        # Where extents go and what gives way for them; the occupancy map; the timed
        # quarantine (pages a writer may still be copying into although it lost them).
        self.retention = Retention([p.size for p in pools], self._lru, retention)  # sessions
        self.pages = Pages(pools, self._lru, self.evict, high_watermark=high_watermark,
                           low_watermark=low_watermark, restart_quarantine=restart_quarantine,
                           clock=lambda: self.clock(), retention=self.retention)  # fmt: skip
        self.accounts = Accounts(quotas or Quotas(), self._lru, self.evict, self.retention)
        self.pools = pools
        self.lease_ttl = lease_ttl
        self.max_lease_ttl = max_lease_ttl
        self.socket_path = socket_path
        self.require_checksums = require_checksums  # seal without {buffer: digest} refused
        self.policy = policy or OPEN_POLICY  # who may use which namespace (policy.py)
        self.max_leases_per_client = max_leases_per_client
        # Leases of each uid's sessions together (a lease costs the daemon ~400 B of memory,
        # charged to no quota: many connections of one uid must not add up without bound)
        self.max_leases_per_uid = max_leases_per_uid
        self.leases_per_uid: Counter[int] = Counter()
        self.started_at = time.time()
        self.sessions: dict[int, Session] = {}
        self.objects: dict[tuple[str, str], StoredObject] = {}
        # The same objects by namespace (key -> object, seal order): list, evict and quotas
        # of one namespace cost what that namespace holds, not what the daemon holds.
        self.by_namespace: dict[str, dict[str, StoredObject]] = {}
        self.pending: dict[tuple[str, str], StoredObject] = {}
        self.leases: dict[int, Lease] = {}
        # Prefix leases pinning only their last block (kvbroker._server.prefix_leases).
        self.lazy_leases: dict[int, Lease] = {}
        self.arenas: dict[int, Arena] = {}  # write arenas of every session, by id
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
        # The sockets of the daemon's read replicas, named in hello (kvbroker._server.replicas)
        self.replica_paths: tuple[str, ...] = ()
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
        args = validate_args(op, raw_args, self)  # (its max_lease_ttl: the TTL rule)
        row = OPS[op]
        if row.needs_hello and not session.greeted:
            raise ProtocolError("the first request on a connection must be hello")
        handler = _HANDLERS.get(op)
        if handler is not None:
            journal = self.journal
            # One write for every record of this request (none when the connection holds a
            # batch for its whole slice of requests: it writes them before the replies).
            if journal is None or not journal.begin():
                return handler(self, session, **args)
            try:
                return handler(self, session, **args)
            finally:
                journal.flush()
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
        self.journal = self.retention.journal = journal
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
                lent: Iterable[tuple[int, int, int]] = (), sessions=(), **checks: Any) -> int:
        """Adopt the sealed objects of a previous daemon (kvbroker._server.restore; ``checks``:
        its ``report``, ``dropped`` and ``verify``), then its sessions' retention."""
        n = restore_state(self, records, lent, sessions, **checks)
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
        self.policy, self.accounts.quotas = policy, quotas
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
                self.pages.hold(pool, start, npages, charges)
                charges = ()  # uncharged with the first extent (they share a deadline)
            else:
                self.pages.free_extent(pool, start, npages)
                if self.journal is not None:
                    self.journal.returned(pool.index, start)
        session.quarantine.clear()
        for namespace, charged in charges:
            self.accounts.uncharge(namespace, charged)
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

    def reserve_extent(self, session, ident, layout, span, meta, ttl, tokens=None,
                       footprint: int | None = None, tenants=None) -> Lease:  # fmt: skip
        """A write lease on a fresh extent for ``ident`` (charged to its namespace and to
        the tenants of ``session``, or to ``tenants`` when given: a pull charges the session
        that asked for it), of at least ``span`` bytes and of the daemon memory its index
        entry takes (``footprint``, when the caller knows it: ``state.index_footprint``)."""
        self.check_lease_limit(session)
        if footprint is None:
            footprint = index_footprint(layout, meta, tokens)
        span = max(span, footprint)
        ps = self.pools[0].page_size  # every pool has the same page size
        if tenants is None:
            tenants = self.accounts.tenants_of(session)
        charged = self.accounts.charge(ident[0], -(-max(span, 1) // ps) * ps, tenants=tenants)
        pages = self.pages
        try:
            pool, start, npages = pages.allocate(max(span, 1), among=pages.pools_for(ident[0]))
        except BaseException:
            self.accounts.uncharge(ident[0], charged, tenants)
            raise
        obj = self.new_object(ident, pool, start, npages, layout, meta)
        obj.charged, obj.tenants, obj.tokens = charged, tenants, tokens
        pages.owners[pool.index][start] = obj
        self.pending[ident] = obj
        if self.journal is not None:  # a restart must not hand these pages to another writer
            self.journal.lent(pool.index, start, npages)
        return self.new_lease("write", session, obj, ttl)

    def seal(self, ls: Lease, *, enforce: bool = True) -> dict:
        """End a write lease by making its object visible."""
        obj = ls.obj
        del self.pending[(obj.namespace, obj.key)]
        self.end_lease(ls, "it was sealed")
        return self.link_sealed(ls.session, obj, enforce=enforce)

    def seal_all(self, leases: list[Lease]) -> None:
        """Seal ``leases`` (parents before children), then evict down to the watermark once:
        evicting after each seal would take a chain's first blocks, leaves until the seal of
        their children a moment later in the same batch."""
        for ls in leases:
            self.seal(ls, enforce=False)
        for pool in {id(ls.obj.pool): ls.obj.pool for ls in leases}.values():
            self.pages.enforce_watermark(pool)

    def link_sealed(self, session: Session, obj: StoredObject, *, enforce: bool = True) -> dict:
        """Make a fully written object visible (replacing an older one of its key); with
        ``enforce``, then evict down to the low watermark if above the high one."""
        ident = (obj.namespace, obj.key)
        old = self.objects.get(ident)
        if old is not None:
            self._unlink(old)
        obj.sealed = True
        obj.linked = True
        obj.last_access = time.time()
        obj.seq = next(self._link_seq)
        self.index(obj)
        self.retention.adopt(obj)  # retained by the session it was reserved for, or in the LRU
        if obj.parent_key is not None:
            # An absent parent (evicted while we wrote) leaves nothing to keep whole.
            parent = self.objects.get((obj.namespace, obj.parent_key))
            if parent is not None and parent is not obj:
                obj.parent, obj.depth = parent, parent.depth + 1
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
        if enforce:
            self.pages.enforce_watermark(obj.pool)
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
        self.retention.pending.pop(obj.serial, None)
        if quarantine:
            # The pages stay charged to the namespace until the writer's connection ends.
            ls.session.quarantine_charges.append((obj.namespace, obj.charged))
            ls.session.quarantine_charges += [(t, obj.charged) for t in obj.tenants]
            obj.charged = 0
            self.pages.owners[obj.pool.index][obj.start] = ("q", obj.npages)
            ls.session.quarantine.append((obj.pool, obj.start, obj.npages))
        else:
            self._free_object(obj)

    # ------------------------------------------------------------------ leases
    def new_lease(self, kind, session, obj, ttl, consume=False) -> Lease:
        ls = Lease(self.registry.next_id(), kind, session, obj, ttl, self.clock() + ttl,
                   consume)  # fmt: skip
        self.leases[ls.id] = ls
        session.leases[ls.id] = ls
        self.leases_per_uid[session.uid] += 1
        self._expire_at(ls)
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
        self._expire_at(ls)

    def _expire_at(self, ls: Lease) -> None:
        """Schedule ``ls``'s expiry. Entries of leases released or renewed since stay in the
        heap until due (up to max_lease_ttl away): past twice the live leases it is rebuilt
        from them, so renewals and claims with long TTLs cannot grow it without bound."""
        expiry = self._expiry
        heapq.heappush(expiry, (ls.expires_at, ls.id))
        if len(expiry) > 2 * len(self.leases) + 1024:
            expiry[:] = [(live.expires_at, live.id) for live in self.leases.values()]
            heapq.heapify(expiry)

    def end_lease(self, ls: Lease, reason: str) -> None:
        del self.leases[ls.id]
        ls.session.leases.pop(ls.id, None)
        uid = ls.session.uid
        if self.leases_per_uid[uid] <= 1:
            del self.leases_per_uid[uid]
        else:
            self.leases_per_uid[uid] -= 1
        self.registry.ended(ls.id, reason)

    def end_read(self, ls: Lease, reason: str, consume: bool) -> None:
        self.end_lease(ls, reason)
        objects = ls.objects()
        if ls.lazy:
            if consume:
                materialize(self, ls)
            else:  # only its leaves count it as a reader (kvbroker._server.prefix_leases)
                del self.lazy_leases[ls.id]
                objects = objects[-ls.lazy:]
        for obj in reversed(objects):  # leaves first, for chains
            obj.readers -= 1
            if consume and obj.linked:
                obj.consumers -= 1
                if self.journal is not None and obj.consumers > 0:
                    self.journal.consumers(obj.serial, obj.consumers)
            if consume and obj.linked and obj.consumers <= 0:
                self._unlink(obj)  # frees now, or when the last other reader leaves
            elif obj.linked:
                if obj.readers == 0 and obj.children == 0 and not self.retention.keeps(obj):
                    self._lru[obj.serial] = obj  # most recently used
            elif obj.readers == 0:
                self._free_object(obj)  # unlinked earlier; the last reader just left

    def pin(self, obj: StoredObject, now: float | None = None) -> None:
        """One more reader: neither evicted nor reused until it leaves."""
        obj.readers += 1
        obj.last_access = time.time() if now is None else now
        self._lru.pop(obj.serial, None)

    def check_lease_limit(self, session: Session) -> None:
        if len(session.leases) >= self.max_leases_per_client:
            raise LimitExceeded(
                f"session {session.id} ({session.name or 'pid ' + str(session.pid)}) holds "
                f"{len(session.leases)} leases, the most one connection may hold "
                "(max_leases_per_client): release some first"
            )
        held = self.leases_per_uid.get(session.uid, 0)
        if held >= self.max_leases_per_uid:
            raise LimitExceeded(
                f"the connections of uid {session.uid} hold {held} leases together, the most "
                "one uid may hold (max_leases_per_uid): release some first"
            )

    def expire(self, now: float | None = None) -> int:
        """End every lease whose TTL passed, and free the timed quarantine whose deadline
        passed; returns how many leases ended."""
        now = self.clock() if now is None else now
        for idx, start, charges in self.pages.release_due(now):
            for namespace, charged in charges:
                self.accounts.uncharge(namespace, charged)
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

    # ------------------------------------------------------------------ unlinking
    def evict(self, obj: StoredObject) -> None:
        assert obj.readers == 0 and obj.sealed and obj.children == 0
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += obj.nbytes
        self._unlink(obj)

    def record_transfer(self, op: str, session: Session, obj: StoredObject, nbytes: int) -> None:
        self.transfers.append((time.time(), op, session.id, obj.namespace, obj.key, nbytes))

    def _unlink(self, obj: StoredObject) -> None:
        """Make an object unreachable; its extents go once no reader holds them."""
        if not obj.linked:
            return
        materialize_holding(self, obj)  # a lazy lease may hold it
        obj.linked = False
        if self.journal is not None:
            self.journal.unlinked(obj.serial)
        del self.objects[(obj.namespace, obj.key)]
        space = self.by_namespace[obj.namespace]
        del space[obj.key]
        if not space:
            del self.by_namespace[obj.namespace]
        self.retention.forget(obj)  # out of the LRU and of every session's retention
        if self.on_block is not None and obj.tokens is not None:
            self.on_block("removed", obj)
        parent, obj.parent = obj.parent, None
        if parent is not None and parent.linked:
            parent.children -= 1
            if parent.children == 0 and parent.readers == 0 and not self.retention.keeps(parent):
                # Oldest end: the chain keeps shrinking from its leaf under pressure.
                self._lru[parent.serial] = parent
                self._lru.move_to_end(parent.serial, last=False)
        if obj.readers == 0:
            self._free_object(obj)

    def _free_object(self, obj: StoredObject) -> None:
        self.pages.free_extent(obj.pool, obj.start, obj.npages)
        if not obj.sealed and self.journal is not None:  # a reservation's pages came back
            self.journal.returned(obj.pool.index, obj.start)
        if obj.charged:
            self.accounts.uncharge(obj.namespace, obj.charged, obj.tenants)
            obj.charged = 0
