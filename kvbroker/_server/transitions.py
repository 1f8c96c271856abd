"""The transitions that span the daemon's owners: the broker's coordinating half.

Each part of the state has one owner that keeps it, makes its own transitions and builds its
own ``statistics()``: the :class:`~kvbroker._server.directory.Directory` (objects,
namespaces, reservations, the LRU, prefix links), the
:class:`~kvbroker._server.leases.LeaseTable` (live pool leases, expiry, limits),
:class:`~kvbroker._server.pages.Pages` (placement, allocation, the occupancy map, the timed
quarantine), :class:`~kvbroker._server.accounts.Accounts` (quota charges),
:class:`~kvbroker._server.arenas.Arenas` (write arenas). :class:`Transitions` owns the
sessions and makes what spans several of them (a reserve is charge + allocate + reserve +
lend + journal), each method saying in one line what it owns and frees. The handlers
(:mod:`kvbroker._server.handlers`) call these; :class:`~kvbroker._server.broker.Broker` adds
the dispatch, the statistics and the warm restart. Who owns and frees what: the ownership
contract in :mod:`kvbroker._server.state`. No I/O, no asyncio.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from .._wire.stats import Counters, Statistics
from .accounts import Accounts
from .arenas import Arenas
from .directory import Directory
from .disk_tier import on_disk_only
from .leases import LeaseRegistry, LeaseTable
from .pages import Pages
from .policy import Policy, Quotas, forget_accounts
from .pool import HostPool
from .prefix_leases import lazy_readers, lend_prefix, materialize, materialize_holding
from .retention import RetentionSettings
from .snapshot import as_seen_by, compose
from .state import OPEN_POLICY, Arena, Lease, Session, StoredObject, index_footprint

__all__ = ["Transitions"]


class _Part:
    """A setting one of the broker's owners keeps: reading and setting it on the broker reads
    and sets the owner's (a reload sets the broker's settings by name)."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, broker: Any, owner: Any = None) -> Any:
        return self if broker is None else getattr(getattr(broker, self.part), self.name)

    def __set__(self, broker: Any, value: Any) -> None:
        setattr(getattr(broker, self.part), self.name, value)


class Transitions:
    """Owns the sessions and coordinates the owners of the state."""

    high_watermark = _Part("pages", "high_watermark")
    low_watermark = _Part("pages", "low_watermark")
    restart_quarantine = _Part("pages", "restart_quarantine")
    quotas = _Part("accounts", "quotas")
    lease_ttl = _Part("leases", "lease_ttl")
    max_lease_ttl = _Part("leases", "max_lease_ttl")
    max_leases_per_client = _Part("leases", "max_leases_per_client")
    max_leases_per_uid = _Part("leases", "max_leases_per_uid")

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
        self.pools = pools
        self.directory = Directory([p.size for p in pools], retention)
        self.retention = self.directory.retention  # sessions (kvbroker._server.retention)
        self.pages = Pages(
            pools,
            self.directory,
            self.evict,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            restart_quarantine=restart_quarantine,
            clock=lambda: self.clock(),
        )
        self.accounts = Accounts(quotas or Quotas(), self.directory, self.pages.give_way)
        self.registry = LeaseRegistry()  # ids of sessions, leases, arenas, ring leases
        self.leases = LeaseTable(
            self.registry,
            lambda: self.clock(),
            lease_ttl=lease_ttl,
            max_lease_ttl=max_lease_ttl,
            max_leases_per_client=max_leases_per_client,
            max_leases_per_uid=max_leases_per_uid,
        )
        self.arenas = Arenas(pools, self.pages, self.accounts, self.registry)
        self.socket_path = socket_path
        self.require_checksums = require_checksums  # seal without {buffer: digest} refused
        self.policy = policy or OPEN_POLICY  # who may use which namespace (policy.py)
        self.started_at = time.time()
        self.sessions: dict[int, Session] = {}
        self._journal: Any = None
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
        self.rings: Any = None  # kvbroker._server.rings.RingService, with --gpu-ring

    @property
    def journal(self) -> Any:
        """The journal (kvbroker._server.journal.Journal) when the daemon keeps one, or None:
        every owner that journals (the write arenas) journals into this one."""
        return self._journal

    @journal.setter
    def journal(self, journal: Any) -> None:
        self._journal = journal
        self.arenas.attach_journal(journal)
        self.retention.journal = journal

    def attach_rings(self, rings: Any) -> None:
        """Owns: the GPU staging rings (``serve --gpu-ring``), lending ids from this broker's
        registry (one id space and one set of lease rules); None: detach them."""
        if rings is not None and rings.registry is not self.registry:
            raise ValueError("the rings must lend their ids from the broker's registry")
        self.rings = rings

    # ------------------------------------------------------------------ statistics
    def statistics(self, occupancy_cells: int = 64) -> Statistics:
        """Everything the daemon can say about itself, each owner's part its own."""
        fleet = self.fleet.statistics() if self.fleet is not None else (None, None)
        directory = self.directory.statistics()
        return compose(
            started_at=self.started_at,
            socket=self.socket_path,
            directory=directory,
            leases=self.leases.statistics(),
            pools=self.pages.statistics(occupancy_cells, self.leases.pinned()),
            accounts=self.accounts.statistics(also=directory.namespaces),
            arenas=self.arenas.statistics(),
            clients=(s.statistics() for s in self.sessions.values()),
            counters=self.counters,
            transfers=self.transfers,
            read_replicas=len(self.replica_paths),
            rings=self.rings.statistics(occupancy_cells) if self.rings is not None else (),
            transfer=fleet[0],
            events=fleet[1],
            retention=self.retention.statistics(),
            disk=None if self.pages.tier is None else self.pages.tier.statistics(),
        )

    def statistics_for(self, session: Session, occupancy_cells: int = 64) -> Statistics:
        """The statistics as ``session`` may see them (``snapshot.as_seen_by``)."""
        fleet = self.fleet
        return as_seen_by(
            self.statistics(occupancy_cells),
            session,
            self.directory.statistics(),
            lambda i: self.pages.named_to(self.pools[i], session),
            fleet.last_failure if fleet is not None else None,
            lambda visible: self.retention.largest(visible=visible),
        )

    def snapshot(self, occupancy_cells: int = 64) -> dict[str, Any]:
        """The statistics as sent on the wire (``Statistics.to_dict``)."""
        return self.statistics(occupancy_cells).to_dict()

    # ------------------------------------------------------------------ sessions
    def open_session(self, pid: int = 0, uid: int = -1, gid: int = -1) -> Session:
        """Owns: a new session (a connection)."""
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
        """Frees: the session, its leases and ring leases; its write-leased pages and its
        quarantine now when the client closed it (its writer is gone), or into the timed
        quarantine when the daemon cut it off (``cut_off``: a peer not reading, a protocol
        error, a stop: its process may still be copying)."""
        for lease in list(session.leases.values()):
            if lease.kind == "write":
                self.abort(lease, "its connection closed", quarantine=cut_off)
            else:
                self.end_read(lease, "its connection closed", consume=False)
        for arena in list(session.arenas.values()):
            self.arenas.end(arena, "its connection closed", hold=cut_off)
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
        """Frees: the write leases and the arena a refused publishing request names
        (``lease``, ``leases``, ``arena``) that are this session's, and their pages: a
        stopping daemon that frees its pools refuses to publish them (``Drain.publishes``)."""
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
                self.abort(ls, reason)
            if lid in self.arenas:
                arena = self.arenas[lid]
                if arena.session is session:
                    self.arenas.end(arena, reason)

    # ------------------------------------------------------------------ writing
    def reserve_extent(
        self,
        session: Session,
        ident: tuple[str, str],
        layout: dict[str, tuple[int, int]],
        span: int,
        meta: dict | None,
        ttl: float,
        tokens: list[int] | None = None,
        footprint: int | None = None,
        tenants: tuple[tuple[str, int], ...] | None = None,
    ) -> Lease:
        """Owns: a write lease on a fresh extent for ``ident`` (charged to its namespace and
        to the tenants of ``session``, or to ``tenants`` when given: a pull charges the
        session that asked for it), of at least ``span`` bytes and of the daemon memory its
        index entry takes (``footprint``: ``state.index_footprint``), journaled as lent.
        Frees: what eviction takes to make room."""
        self.leases.check_limit(session)
        if footprint is None:
            footprint = index_footprint(layout, meta, tokens)
        span = max(span, footprint, 1)
        ps = self.pools[0].page_size  # every pool has the same page size
        if tenants is None:
            tenants = self.accounts.tenants_of(session)
        charged = self.accounts.charge(ident[0], -(-span // ps) * ps, tenants=tenants)
        pages = self.pages
        try:
            pool, start, npages = pages.allocate(span, among=pages.pools_for(ident[0]))
        except BaseException:
            self.accounts.uncharge(ident[0], charged, tenants)
            raise
        obj = self.directory.new_object(ident, pool, start, npages, layout, meta)
        obj.charged, obj.tenants, obj.tokens = charged, tenants, tokens
        pages.take(pool, start, obj)
        self.directory.reserve(obj)
        if self.journal is not None:  # a restart must not hand these pages to another writer
            self.journal.lent(pool.index, start, npages)
        return self.leases.lend("write", session, obj, ttl)

    def reserve_all(self, session: Session, plans: list, ttl: float) -> list[Lease | None]:
        """Owns: a write lease per plan ``(ident, parent, layout, span, meta, tokens,
        footprint)`` whose key is free (None for one sealed, being written or on the disk
        tier: sealing it again would replace the disk copy with the same bytes), all or
        nothing: a failure frees every one of them."""
        taken: list[Lease] = []
        slots: list[Lease | None] = []
        tier = self.pages.tier
        try:
            for ident, parent, layout, span, meta, tokens, cost in plans:
                if self.directory.taken(ident) or on_disk_only(tier, ident):
                    slots.append(None)
                    continue
                lease = self.reserve_extent(session, ident, layout, span, meta, ttl, tokens, cost)
                lease.obj.parent_key = parent  # resolved at seal: it may be in this batch
                taken.append(lease)
                slots.append(lease)
        except BaseException:
            for lease in taken:  # a failed batch holds no pages
                self.abort(lease, "its batch failed")
            raise
        return slots

    def seal(self, ls: Lease, *, enforce: bool = True) -> dict:
        """Frees: the write lease ``ls``. Owns: its object, sealed and visible."""
        self.directory.unreserve(ls.obj)
        self.leases.end(ls, "it was sealed")
        return self.link_sealed(ls.session, ls.obj, enforce=enforce)

    def seal_all(self, leases: list[Lease]) -> None:
        """Seal ``leases`` (parents before children), then evict down to the watermark once:
        evicting after each seal would take a chain's first blocks, leaves until the seal of
        their children a moment later in the same batch."""
        for ls in leases:
            self.seal(ls, enforce=False)
        for pool in {id(ls.obj.pool): ls.obj.pool for ls in leases}.values():
            self.pages.enforce_watermark(pool)

    def link_sealed(self, session: Session, obj: StoredObject, *, enforce: bool = True) -> dict:
        """Owns: a fully written ``obj``, visible and journaled. Frees: the older object of its
        key; with ``enforce``, what the high watermark evicts (down to the low one)."""
        ident = (obj.namespace, obj.key)
        old = self.directory.get(ident)
        if old is not None:
            self._unlink(old)
        self.directory.link(obj)
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

    def publish(
        self, session: Session, ar: Arena, obj: StoredObject, next_arena: int
    ) -> tuple[dict, Arena | None]:
        """Owns: ``obj`` carved out of the arena ``ar`` and sealed, and the arena now held
        (its rest, or a fresh one of ``next_arena`` bytes). Returns the seal's reply and it."""
        kept = self.arenas.carve(session, ar, obj, next_arena)
        return self.link_sealed(session, obj), kept

    def abort(self, ls: Lease, reason: str, quarantine: bool = False) -> None:
        """Frees: the write lease ``ls`` and its object; its pages now, or with ``quarantine``
        (its writer may still be copying) on the writer's session until it ends, still
        charged."""
        obj = ls.obj
        self.directory.discard(obj)
        if quarantine:
            ls.session.quarantine_charges.append((obj.namespace, obj.charged))
            ls.session.quarantine_charges += [(t, obj.charged) for t in obj.tenants]
            obj.charged = 0
            self.pages.take(obj.pool, obj.start, ("q", obj.npages))
            ls.session.quarantine.append((obj.pool, obj.start, obj.npages))
        else:
            self._free_object(obj)
        self.leases.end(ls, reason)

    def abort_held(self, ls: Lease, reason: str) -> None:
        """Frees: the write lease ``ls`` and its object; its pages into the timed quarantine
        with their namespace charge (a failed pull whose READ may still land)."""
        obj = ls.obj
        self.directory.discard(obj)
        charges = ((obj.namespace, obj.charged),) if obj.charged else ()
        obj.charged = 0
        self.leases.end(ls, reason)
        self.pages.hold(obj.pool, obj.start, obj.npages, charges)

    # ------------------------------------------------------------------ reading
    def claim(
        self, session: Session, obj: StoredObject, ttl: float, consume: bool, nbytes: int
    ) -> Lease:
        """Owns: a read lease of ``session`` on ``obj`` (pinned: neither evicted nor reused),
        ``nbytes`` of it counted as claimed."""
        self.leases.check_limit(session)
        self.directory.pin(obj)
        lease = self.leases.lend("read", session, obj, ttl, consume=consume)
        c = self.counters
        c["claims"] += 1
        c["hits"] += 1
        c["bytes_out"] += nbytes
        session.bytes_claimed += nbytes
        self.record_transfer("claim", session, obj, nbytes)
        return lease

    def match(self, session: Session, found: list[StoredObject], ttl: float) -> tuple:
        """Owns: one read lease of ``session`` over the prefix ``found`` (``lend_prefix``).
        Returns it, the names, the packed rows (or None) and the bytes leased."""
        self.leases.check_limit(session)
        lease, names, packed, nbytes = lend_prefix(self.directory, self.leases, session, found, ttl)
        self.counters["bytes_out"] += nbytes
        session.bytes_claimed += nbytes
        return lease, names, packed, nbytes

    def end_read(self, ls: Lease, reason: str, consume: bool) -> None:
        """Frees: the read lease ``ls``; with ``consume``, one consumer of each object it holds
        (an object with none left is unlinked); an unlinked object's pages once its last
        reader left."""
        self.leases.end(ls, reason)
        objects = ls.objects()
        if ls.lazy:
            if consume:
                materialize(self.leases, ls)
            else:  # only its leaves count it as a reader (kvbroker._server.prefix_leases)
                self.leases.unlazy(ls)
                objects = objects[-ls.lazy :]
        for obj in reversed(objects):  # leaves first, for chains
            linked = obj.linked
            if self.directory.unpin(obj, consume):
                if linked:
                    self._unlink(obj)  # consumed: frees now, or when the last reader leaves
                else:
                    self._free_object(obj)  # unlinked earlier; the last reader just left
            elif consume and linked and self.journal is not None:
                self.journal.consumers(obj.serial, obj.consumers)

    def expire(self, now: float | None = None) -> int:
        """Frees: every lease whose TTL passed (a write lease's pages quarantined on its
        session), and the timed quarantine whose deadline passed; returns how many leases
        ended."""
        now = self.clock() if now is None else now
        for idx, start, charges in self.pages.release_due(now):
            for namespace, charged in charges:
                self.accounts.uncharge(namespace, charged)
            if self.journal is not None:
                self.journal.returned(idx, start)
        ended = 0
        for ls in self.leases.due(now):
            reason = f"its {ls.ttl:g} s TTL passed without renewal"
            if ls.kind == "write":
                self.abort(ls, reason, quarantine=True)
            else:
                self.end_read(ls, reason, consume=False)
            self.counters["expired_leases"] += 1
            ended += 1
        return ended

    def lookup(self, obj: StoredObject) -> dict[str, Any]:
        """``obj``'s info with its readers all counted (a lazy lease holding it made eager)."""
        materialize_holding(self.leases, obj)
        return obj.info()

    def lazy_readers(self) -> Any:
        """The readers lazy leases add to blocks (``prefix_leases.lazy_readers``); empty
        when there is none."""
        return lazy_readers(self.leases) if self.leases.lazy else {}

    # ------------------------------------------------------------------ unlinking
    def evict(self, obj: StoredObject) -> None:
        """Frees: the evictable ``obj`` (unlinked, its pages back to the pools)."""
        assert obj.readers == 0 and obj.sealed and obj.children == 0
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += obj.nbytes
        self._unlink(obj)

    def evict_all(self, victims: list[StoredObject], cleared: bool) -> None:
        """Frees: ``victims`` (leaves before parents); ``cleared``: every object went, which
        a router hears as one event."""
        for obj in victims:
            self.directory.evicting(obj, "operator")
            self.evict(obj)
        if cleared and self.on_block is not None:
            self.on_block("cleared", None)

    def in_batch(self, work: Callable[[], Any]) -> Any:
        """``work()`` with one journal write for its records (as a request has it)."""
        journal = self.journal
        if journal is None or not journal.begin():
            return work()
        try:
            return work()
        finally:
            journal.flush()

    def record_transfer(self, op: str, session: Session, obj: StoredObject, nbytes: int) -> None:
        self.transfers.append((time.time(), op, session.id, obj.namespace, obj.key, nbytes))

    def _unlink(self, obj: StoredObject) -> None:
        """Frees: ``obj``'s key (journaled, announced); its pages once no reader holds them."""
        if not obj.linked:
            return
        materialize_holding(self.leases, obj)  # a lazy lease may hold it
        self.directory.unlink(obj)
        if self.journal is not None:
            self.journal.unlinked(obj.serial)
        if self.on_block is not None and obj.tokens is not None:
            self.on_block("removed", obj)
        if obj.readers == 0:
            self._free_object(obj)

    def _free_object(self, obj: StoredObject) -> None:
        self.pages.free_extent(obj.pool, obj.start, obj.npages)
        if not obj.sealed and self.journal is not None:  # a reservation's pages came back
            self.journal.returned(obj.pool.index, obj.start)
        if obj.charged:
            self.accounts.uncharge(obj.namespace, obj.charged, obj.tenants)
            obj.charged = 0
