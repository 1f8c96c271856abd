"""The broker's state machine: objects, leases, eviction, statistics. No I/O, no asyncio.

Primitives, and who owns and frees what
---------------------------------------

*Pool extent* — a run of pages of one host pool. The broker owns every extent; a client only
ever borrows one through a lease, and the broker alone returns it to the allocator.

*Write lease* (``reserve``) — fresh extents for ``(namespace, key)``, laid out as the named
buffers asked for. The holder writes into its mapping, then:

- ``seal``: the object becomes visible atomically (replacing the old one when asked); the
  lease ends and the extents now belong to the sealed object;
- ``abort`` or the connection closing: the object is discarded, its extents freed;
- TTL expiry with the writer still connected: the object is discarded, but its extents are
  *quarantined* on the writer's session, not reused, until that connection ends — a slow
  writer may still be writing into them;
- the daemon cutting the writer off (replies left unread past ``max_write_buffer``, a
  protocol error, a stop): the writer's process may still be copying, so its write-leased
  pages (reservations, arenas, its quarantine) go into the *timed quarantine*: not
  allocatable for ``restart_quarantine`` seconds, then freed by ``expire``.

*Restart quarantine* — pages lent for writing are journaled (``_journal.py``, ``w`` records,
ended by the seal or an ``e`` record). A daemon adopting a dead one's pools puts the pages
still lent at the crash into the timed quarantine too: the writer may outlive the daemon and
finish its copy into pages a new owner would already hold. Quarantined pages count as used
and as ``quarantined`` in ``stat``; they are freed by the broker alone, at the deadline.

*Write arena* (``arena``, then ``publish``) — fresh pages lent to one session with no TTL, so
a put can be one round trip: the client copies into them first, then ``publish`` turns the
arena's first pages into a sealed object (the extent is split, nothing is copied) and the rest
stays the arena, or a fresh one replaces it. An arena is freed by ``abort``, by being published
whole, or when its client closes the connection (its writer is gone: no quarantine needed; if
the daemon cut it off, it goes into the timed quarantine, see below). It counts as
used and write-leased, is never evicted, and is at most 1/16 of a pool.

*Read lease* (``claim``) — while held, the object's extents are neither evicted nor reused.
It ends on ``release``, on TTL expiry, or when the connection closes. A claim with
``consume`` counts down the object's ``consumers`` (set at reserve, default 1) when that lease
is released; at zero the object is unlinked, and its extents are freed once the last read
lease on it ends. A consumer that crashes before releasing does not count: the object stays
for a retry (or for eviction).

*Fencing* — lease ids are never reused. Using an ended lease raises
:class:`~kvbroker.errors.LeaseExpired` saying why it ended; a reader that gets it on
``release`` must assume what it read may have been overwritten.

*Eviction* — least recently used among sealed objects with no read lease, when a reservation
does not fit, or after a seal pushes a pool past its high watermark (down to the low one).
Leased and unsealed objects are never evicted. A reservation that cannot fit even after
evicting everything evictable fails at once with :class:`~kvbroker.errors.PoolFull`, and then
nothing is evicted for it.
"""

from __future__ import annotations

import bisect
import heapq
import os
import re
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from itertools import count
from typing import Any

import msgpack
import re2

from .._version import __version__
from .allocator import ExtentAllocator
from .._wire import checksum as _checksum
from .._wire.objects import buffer_offsets
from .pool import HostPool
from .._wire.names import check_buffer_name
from .._wire.protocol import MAX_BUFFERS, MAX_META, MAX_NAME, PROTOCOL_VERSION, validate_args
from .policy import Access, Policy, Quotas
from ..errors import BadRequest, Exists, Forbidden, LeaseExpired, NotFound, PoolFull, ProtocolError
from ..errors import LimitExceeded, QuotaExceeded

__all__ = ["Broker", "Session", "WouldWait"]

# Buffers inside an object start on this boundary: enough for any dtype and for DMA engines.
_MAX_ENDED = 1 << 16
_MAX_LIST = 10_000
_MAX_REPORTED_LEASES = 256
_MAX_REGEX = 1024
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the client's error, answered, not logged
_MAX_NAMESPACES = 1000  # rows of per-namespace usage in a snapshot
_OPEN = Policy()

# A write arena is at most this fraction of its pool, and all arenas together at most
# _ARENA_BUDGET_FRACTION of the pools: idle arenas of many clients must not hold the pool
# hostage (they are not evictable). An arena never evicts a sealed object either: it is an
# optimisation, and a client without one falls back to reserve + seal.
_ARENA_POOL_FRACTION = 16
_ARENA_BUDGET_FRACTION = 4


class WouldWait(Exception):
    """Raised by ``claim`` with ``wait``: the async layer retries after the key is sealed."""

    def __init__(self, key: tuple[str, str], timeout: float) -> None:
        self.key = key
        self.timeout = timeout


class Session:
    """One client connection, as the broker sees it."""

    __slots__ = (
        "id", "pid", "uid", "gid", "name", "role", "connected_at", "leases", "quarantine",
        "bytes_published", "bytes_claimed", "greeted", "arenas", "access", "quarantine_charges",
    )  # fmt: skip

    def __init__(self, sid: int, pid: int, uid: int, gid: int) -> None:
        self.id = sid
        self.pid, self.uid, self.gid = pid, uid, gid
        self.name = ""
        self.role = ""
        self.connected_at = time.time()
        self.leases: dict[int, Lease] = {}
        self.quarantine: list[tuple[HostPool, int, int]] = []
        # (namespace, bytes) still charged for quarantined pages: a tenant must not get
        # its quota back by letting write leases expire; uncharged when the session ends.
        self.quarantine_charges: list[tuple[str, int]] = []
        self.arenas: dict[int, Arena] = {}
        self.access: Access = _OPEN.access(uid, gid)  # what the policy lets it do
        self.bytes_published = 0
        self.bytes_claimed = 0
        self.greeted = False


class StoredObject:
    __slots__ = (
        "namespace", "key", "pool", "start", "npages", "nbytes", "buffers", "meta",
        "created_at", "last_access", "sealed", "readers", "linked", "serial", "consumers",
        "parent", "parent_key", "children", "checksums", "charged", "extents",
    )  # fmt: skip

    def __init__(self, namespace, key, pool, start, npages, nbytes, buffers, meta, serial):
        self.namespace: str = namespace
        self.key: str = key
        self.pool: HostPool = pool
        self.start: int = start
        self.npages: int = npages
        self.nbytes: int = nbytes
        self.buffers: dict[str, tuple[int, int]] = buffers  # name -> (pool offset, nbytes)
        self.meta: dict | None = meta
        self.created_at = time.time()
        self.last_access = self.created_at
        self.sealed = False
        self.readers = 0
        self.linked = False  # reachable through Broker.objects
        self.serial: int = serial
        self.consumers = 1  # consume-claims still to be released before the object goes
        self.parent: StoredObject | None = None  # previous block of a prefix chain
        self.parent_key: str | None = None
        self.children = 0  # sealed blocks naming this one as parent: not evictable before them
        # {buffer: xxh3_64} computed by the writer, recorded at seal (kvbroker._integrity).
        self.checksums: dict[str, int] | None = None
        self.charged = 0  # bytes counted against its namespace's quota until freed
        self.extents: tuple[tuple[str, ...], bytes] | None = None  # see compact_extents

    def compact_extents(self) -> tuple[tuple[str, ...], bytes]:
        """(buffer names, little-endian int64 [pool, offset, nbytes, offset, nbytes, ...]),
        the form a prefix match replies in; built on first use and kept (buffers never move
        once reserved)."""
        if self.extents is None:
            flat = [self.pool.index]
            for off, n in self.buffers.values():
                flat += (off, n)
            self.extents = (tuple(self.buffers), struct.pack(f"<{len(flat)}q", *flat))
        return self.extents

    # The fields that survive a warm restart (see _journal.py). A new per-object field that a
    # restarted daemon must still know goes here; ``pool`` and ``parent`` travel as indices.
    PERSISTED = (
        "serial", "namespace", "key", "start", "npages", "nbytes", "meta", "created_at",
        "consumers", "parent_key", "checksums",
    )  # fmt: skip

    def to_record(self) -> dict[str, Any]:
        """This sealed object as a journal record (msgpack-able)."""
        rec = {name: getattr(self, name) for name in self.PERSISTED}
        rec["pool"] = self.pool.index
        rec["buffers"] = self.buffers
        rec["parent"] = self.parent.serial if self.parent is not None else None
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any], pools: list[HostPool]) -> StoredObject:
        """A sealed object back from its journal record; ``parent`` is resolved by the
        caller (it names a serial)."""
        buffers = {name: (int(off), int(n)) for name, (off, n) in rec["buffers"].items()}
        obj = cls(rec["namespace"], rec["key"], pools[rec["pool"]], rec["start"],
                  rec["npages"], rec["nbytes"], buffers, rec["meta"], rec["serial"])  # fmt: skip
        for name in cls.PERSISTED:
            if name in rec:
                setattr(obj, name, rec[name])
        obj.last_access = obj.created_at
        obj.sealed = True
        return obj

    def info(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "key": self.key,
            "nbytes": self.nbytes,
            "buffers": len(self.buffers),
            "pool": self.pool.index,
            "readers": self.readers,
            "created_at": self.created_at,
            "last_access": self.last_access,
            "meta": self.meta,
        }


class Lease:
    __slots__ = ("id", "kind", "session", "obj", "more", "ttl", "expires_at", "consume")

    def __init__(self, lid, kind, session, obj, ttl, expires_at, consume=False):
        self.id: int = lid
        self.kind: str = kind
        self.session: Session = session
        self.obj: StoredObject = obj
        # A prefix match reads many blocks under one lease: the blocks after the first.
        self.more: tuple[StoredObject, ...] = ()
        self.ttl: float = ttl
        self.expires_at: float = expires_at
        self.consume: bool = consume

    def objects(self):
        return (self.obj, *self.more) if self.more else (self.obj,)


class Arena:
    """A write arena: pages a session may fill before naming them (``publish``).

    Owned by the broker like every extent; lent to one session until that session publishes
    all of it, aborts it, or disconnects (then it is freed: its writer is gone; or, when the
    daemon cut it off, held in the timed quarantine, since its writer may still be copying). It has no
    TTL: an expired arena would be quarantined until disconnect anyway, which frees nothing
    sooner. Its pages count as used and as leased for writing; it is never evicted.
    """

    __slots__ = ("id", "session", "pool", "start", "npages")

    def __init__(self, aid: int, session: Session, pool: HostPool, start: int, npages: int):
        self.id = aid
        self.session = session
        self.pool = pool
        self.start = start
        self.npages = npages

    def extent(self) -> list[int]:
        ps = self.pool.page_size
        return [self.pool.index, self.start * ps, self.npages * ps]


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
        self.policy = policy or _OPEN  # who may use which namespace (kvbroker._server.policy)
        self.quotas = quotas or Quotas()
        self.max_leases_per_client = max_leases_per_client
        # Timed quarantine: a heap of (deadline, pool index, start, npages, charges) — pages a
        # writer may still be copying into although it lost them (daemon restart, cut off).
        self.restart_quarantine = restart_quarantine
        self._held: list[tuple[float, int, int, int, tuple[tuple[str, int], ...]]] = []
        self._usage: dict[str, int] = {}  # namespace -> bytes charged (pages of its objects)
        self.started_at = time.time()
        self.sessions: dict[int, Session] = {}
        self.objects: dict[tuple[str, str], StoredObject] = {}
        self.pending: dict[tuple[str, str], StoredObject] = {}
        self.leases: dict[int, Lease] = {}
        self.arenas: dict[int, Arena] = {}  # write arenas of every session, by id
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()  # sealed, linked, unleased
        self._owners: list[dict[int, Any]] = [{} for _ in pools]  # start -> object | ("q", n)
        self._expiry: list[tuple[float, int]] = []
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._ids = count(1)
        # Warm restart (_journal.py): the daemon sets these when it keeps a journal.
        self.journal: Any = None  # kvbroker._server.journal.Journal, or None
        self.epoch = 1  # starts of this socket's daemon that adopted the previous one's pools
        self._first_id = 1  # ids below were handed out by an earlier daemon
        self._id_limit = 1 << 62
        self._serials = count(1)
        self._regex_cache: dict[str, re.Pattern] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("publishes", "claims", "bytes_in", "bytes_out", "hits", "misses", "evictions",
             "evicted_bytes", "aborts", "expired_leases", "requests", "errors",
             "prefix_queries", "prefix_hit_blocks", "prefix_miss_blocks", "prefix_hit_tokens"),
            0,
        )  # fmt: skip
        self.transfers: deque[dict[str, Any]] = deque(maxlen=64)
        # Called with (namespace, key) after each seal; the daemon wakes waiting claims.
        self.on_sealed: Callable[[tuple[str, str]], None] | None = None
        # GPU staging rings (kvbroker._server.rings.RingService) when serving with --gpu-ring.
        self.rings: Any = None

    # ------------------------------------------------------------------ warm restart
    def attach_journal(self, journal: Any, next_id: int) -> None:
        """Journal every change of the index from now on; ids continue from ``next_id``."""
        self.journal = journal
        self.epoch = journal.epoch
        self._first_id = next_id
        self._ids = count(next_id)
        journal.rewrite(self.journal_records(), next_id, self.journal_lent())
        self._id_limit = journal.id_limit

    def compact_journal(self) -> None:
        """Rewrite the journal as the live objects only (the daemon calls this off the
        request path, when the log has grown to twice what is live)."""
        self.journal.rewrite(self.journal_records(), next(self._ids), self.journal_lent())
        self._id_limit = self.journal.id_limit

    def journal_records(self) -> list[dict[str, Any]]:
        """Every sealed, linked object as a journal record, in seal order."""
        return [obj.to_record() for obj in self.objects.values()]

    def journal_lent(self) -> list[tuple[int, int, int]]:
        """Every extent not free and not a sealed object's, as (pool, start, npages):
        reservations, write arenas, quarantined pages. A restart quarantines them."""
        out = [(o.pool.index, o.start, o.npages) for o in self.pending.values()]
        out += [(a.pool.index, a.start, a.npages) for a in self.arenas.values()]
        for s in self.sessions.values():
            out += [(pool.index, start, n) for pool, start, n in s.quarantine]
        out += [(idx, start, n) for _, idx, start, n, _ in self._held]
        return out

    def restore(self, records: Iterable[dict[str, Any]],
                lent: Iterable[tuple[int, int, int]] = ()) -> int:  # fmt: skip
        """Adopt the sealed objects of a previous daemon (records in seal order) into an
        empty broker: the allocators are rebuilt from their extents; ``lent`` (pool, start,
        npages), the pages it had lent for writing, go into the timed quarantine (their
        writers may still be copying); everything else is free. Returns how many objects
        came back."""
        if self.objects or self.pending:
            raise RuntimeError("restore needs an empty broker")
        by_serial: dict[int, StoredObject] = {}
        live: list[list[tuple[int, int]]] = [[] for _ in self.pools]
        for rec in records:
            obj = StoredObject.from_record(rec, self.pools)
            parent = by_serial.get(rec.get("parent"))
            if parent is not None:
                obj.parent = parent
                parent.children += 1
                self._lru.pop(parent.serial, None)
            obj.linked = True
            by_serial[obj.serial] = obj
            self.objects[(obj.namespace, obj.key)] = obj
            self._owners[obj.pool.index][obj.start] = obj
            if obj.children == 0:
                self._lru[obj.serial] = obj
            live[obj.pool.index].append((obj.start, obj.npages))
            obj.charged = self._charge(obj.namespace, obj.npages * obj.pool.page_size, False)
        held = _disjoint(lent, live, [p.allocator.capacity for p in self.pools])
        deadline = self.clock() + self.restart_quarantine
        for idx, start, npages in held:
            live[idx].append((start, npages))
            self._owners[idx][start] = ("q", npages)
            heapq.heappush(self._held, (deadline, idx, start, npages, ()))
        for pool, extents in zip(self.pools, live):
            pool.allocator = ExtentAllocator.with_live(pool.allocator.capacity, extents)
        top = max(by_serial, default=0)
        self._serials = count(top + 1)
        return len(by_serial)

    # ------------------------------------------------------------------ sessions
    def open_session(self, pid: int = 0, uid: int = -1, gid: int = -1) -> Session:
        s = Session(self._next_id(), pid, uid, gid)
        s.access = self.policy.access(uid, gid)
        self.sessions[s.id] = s
        return s

    def set_policy(self, policy: Policy, quotas: Quotas) -> None:
        """A reload: new rules apply to every connection from its next request on."""
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
                self._discard_pending(lease, quarantine=cut_off)
                self._end_lease(lease, "its connection closed")
            else:
                self._end_read(lease, "its connection closed", consume=False)
        for arena in list(session.arenas.values()):
            self._end_arena(arena, "its connection closed", hold=cut_off)
        charges = tuple(session.quarantine_charges)
        for pool, start, npages in session.quarantine:
            if cut_off:
                self._hold(pool, start, npages, charges)
                charges = ()  # uncharged with the first extent (they share a deadline)
            else:
                self._free_extent(pool, start, npages)
                if self.journal is not None:
                    self.journal.returned(pool.index, start)
        session.quarantine.clear()
        for namespace, charged in charges:
            self._uncharge(namespace, charged)
        session.quarantine_charges.clear()
        if self.rings is not None:
            self.rings.close_session(session)
        self.sessions.pop(session.id, None)

    # ------------------------------------------------------------------ dispatch
    def handle(self, session: Session, op: str, raw_args: Any) -> Any:
        """Run one request; returns its result or raises a KVBrokerError (or WouldWait)."""
        self.counters["requests"] += 1
        args = validate_args(op, raw_args)
        if op != "hello" and not session.greeted:
            raise ProtocolError("the first request on a connection must be hello")
        if op.startswith("ring"):
            if self.rings is None:
                raise BadRequest(f"{op}: this daemon has no GPU rings (serve --gpu-ring SIZE)")
            return self.rings.handle(session, op, args)
        return getattr(self, "_op_" + op)(session, **args)

    def _op_hello(self, session: Session, version: int, name: str, role: str) -> dict:
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (daemon speaks {PROTOCOL_VERSION})"
            )
        session.name, session.role, session.greeted = name[:MAX_NAME], role[:MAX_NAME], True
        return {
            "version": PROTOCOL_VERSION,
            "server_version": __version__,
            "server_pid": os.getpid(),
            "session": session.id,
            "lease_ttl": self.lease_ttl,
            "pools": [p.describe() for p in self.pools],
            "epoch": self.epoch,
        }

    # ------------------------------------------------------------------ publish
    def _op_reserve(self, session, namespace, key, buffers, meta, replace, ttl, consumers):
        if not 1 <= consumers <= 1 << 16:
            raise BadRequest("reserve: consumers must be between 1 and 65536")
        ttl = self._ttl(ttl)
        ident = (_check_name("namespace", namespace), _check_name("key", key))
        session.access.check(namespace, True, "reserve")
        layout, span = _buffer_layout(buffers, meta)
        if ident in self.pending:
            raise Exists(f"{namespace}/{key} is being published by another writer")
        if ident in self.objects and not replace:
            raise Exists(f"{namespace}/{key} is already published")
        lease = self._reserve(session, ident, layout, span, meta, ttl)
        lease.obj.consumers = consumers
        return {"lease": lease.id, "ttl": ttl, "buffers": _extents(lease.obj, lease.obj.buffers)}

    def _reserve(self, session, ident, layout, span, meta, ttl) -> Lease:
        self._check_lease_limit(session)
        ps = self.pools[0].page_size  # every pool has the same page size
        charged = self._charge(ident[0], -(-max(span, 1) // ps) * ps)
        try:
            pool, start, npages = self._allocate(max(span, 1))
        except BaseException:
            self._uncharge(ident[0], charged)
            raise
        base = start * pool.page_size
        obj = StoredObject(
            ident[0], ident[1], pool, start, npages, sum(n for _, n in layout.values()),
            {name: (base + off, n) for name, (off, n) in layout.items()}, meta,
            next(self._serials),
        )  # fmt: skip
        obj.charged = charged
        self._owners[pool.index][start] = obj
        self.pending[ident] = obj
        if self.journal is not None:  # a restart must not hand these pages to another writer
            self.journal.lent(pool.index, start, npages)
        return self._new_lease("write", session, obj, ttl)

    def _op_reserve_blocks(self, session, namespace, blocks, ttl) -> dict:
        ttl = self._ttl(ttl)
        _check_name("namespace", namespace)
        session.access.check(namespace, True, "reserve_blocks")
        if len(blocks) > MAX_BUFFERS:
            raise BadRequest(f"reserve_blocks: at most {MAX_BUFFERS} blocks per request")
        plans = []
        for i, blk in enumerate(blocks):  # validate everything before reserving anything
            if not isinstance(blk, dict) or not isinstance(blk.get("key"), str):
                raise BadRequest(f"reserve_blocks: block {i} must be a map with a string key")
            parent = blk.get("parent")
            if parent is not None and not isinstance(parent, str):
                raise BadRequest(f"reserve_blocks: block {i}: parent must be a key or null")
            bufs, meta = blk.get("buffers"), blk.get("meta")
            if not isinstance(bufs, dict) or (meta is not None and not isinstance(meta, dict)):
                raise BadRequest(f"reserve_blocks: block {i}: buffers (and meta) must be maps")
            ident = (namespace, _check_name("key", blk["key"]))
            plans.append((ident, parent, *_buffer_layout(bufs, meta), meta))
        results, taken = [], []
        try:
            for ident, parent, layout, span, meta in plans:
                if ident in self.objects or ident in self.pending:
                    results.append({"exists": True})
                    continue
                lease = self._reserve(session, ident, layout, span, meta, ttl)
                lease.obj.parent_key = parent  # resolved at seal: it may be in this batch
                taken.append(lease)
                results.append({"lease": lease.id, "buffers": _extents(lease.obj, lease.obj.buffers)})
        except BaseException:
            for lease in taken:  # all or nothing: a failed batch holds no pages
                self._discard_pending(lease, quarantine=False)
                self._end_lease(lease, "its batch failed")
            raise
        return {"ttl": ttl, "results": results}

    def _op_seal_many(self, session, leases, checksums) -> dict:
        if checksums is not None and len(checksums) != len(leases):
            raise BadRequest("seal_many: checksums must have one entry (map or null) per lease")
        for i, lid in enumerate(leases):
            if not isinstance(lid, int) or isinstance(lid, bool):
                raise BadRequest("seal_many: leases must be a list of lease ids")
            self._op_seal(session, lid, None if checksums is None else checksums[i])
        return {"sealed": len(leases)}

    def _op_seal(self, session, lease, checksums=None) -> dict:
        ls = self._lease(session, lease, "write")
        obj = ls.obj
        self._accept_checksums(obj, checksums)
        del self.pending[(obj.namespace, obj.key)]
        self._end_lease(ls, "it was sealed")
        return self._link_sealed(session, obj)

    def _accept_checksums(self, obj: StoredObject, checksums: dict | None) -> None:
        if checksums is not None:
            try:
                obj.checksums = _checksum.validate(checksums, obj.buffers)
            except ValueError as exc:
                raise BadRequest(f"seal of {obj.namespace}/{obj.key}: {exc}") from None
        elif self.require_checksums:
            raise BadRequest(
                f"seal of {obj.namespace}/{obj.key}: this daemon requires a checksum per "
                "buffer (require_checksums); seal with checksums"
            )

    def _link_sealed(self, session: Session, obj: StoredObject) -> dict:
        """Make a fully written object visible (replacing an older one of its key)."""
        ident = (obj.namespace, obj.key)
        old = self.objects.get(ident)
        if old is not None:
            self._unlink(old)
        obj.sealed = True
        obj.linked = True
        obj.last_access = time.time()
        self.objects[ident] = obj
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
        self._record("publish", session, obj, obj.nbytes)
        self._enforce_watermark(obj.pool)
        if self.on_sealed is not None:
            self.on_sealed(ident)
        return {"namespace": obj.namespace, "key": obj.key, "nbytes": obj.nbytes}

    # ------------------------------------------------------------------ write arenas
    def _op_arena(self, session, nbytes) -> dict:
        if nbytes <= 0:
            raise BadRequest("arena: nbytes must be positive")
        if session.arenas:  # one a connection: arenas are neither quota-charged nor evictable
            held = next(iter(session.arenas))
            raise BadRequest(f"arena: this connection already holds write arena {held}; "
                             "abort it first")  # fmt: skip
        arena = self._new_arena(session, nbytes)
        return {"lease": arena.id, "arena": arena.extent()}

    def _new_arena(self, session: Session, nbytes: int) -> Arena:
        cap = max(p.size for p in self.pools) // _ARENA_POOL_FRACTION
        nbytes = max(1, min(nbytes, cap))
        held = sum(a.npages * a.pool.page_size for a in self.arenas.values())
        budget = sum(p.size for p in self.pools) // _ARENA_BUDGET_FRACTION
        if held + nbytes > budget:
            raise PoolFull(f"write arenas already hold {held} of their {budget} bytes")
        pool, start, npages = self._allocate(nbytes, evict=False)
        arena = Arena(self._next_id(), session, pool, start, npages)
        if self.journal is not None:
            self.journal.lent(pool.index, start, npages)
        self._owners[pool.index][start] = ("w", npages)
        self.arenas[arena.id] = arena
        session.arenas[arena.id] = arena
        return arena

    def _end_arena(self, arena: Arena, reason: str, hold: bool = False) -> None:
        del self.arenas[arena.id]
        del arena.session.arenas[arena.id]
        if hold:  # its writer may still be copying (see close_session)
            self._hold(arena.pool, arena.start, arena.npages)
        else:
            self._free_extent(arena.pool, arena.start, arena.npages)
            if self.journal is not None:
                self.journal.returned(arena.pool.index, arena.start)
        self._ended[arena.id] = reason
        if len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)

    def _arena(self, session: Session, aid: int) -> Arena:
        arena = self.arenas.get(aid)
        if arena is None:
            reason = self._ended.get(aid)
            if reason is not None:
                raise LeaseExpired(f"arena {aid} has ended: {reason}")
            raise BadRequest(f"no arena {aid}")
        if arena.session is not session:
            raise Forbidden(f"arena {aid} is held by another connection")
        return arena

    def _op_publish(self, session, arena, namespace, key, buffers, meta, replace, consumers,
                    checksums, next_arena) -> dict:  # fmt: skip
        ar = self._arena(session, arena)
        if not 1 <= consumers <= 1 << 16:
            raise BadRequest("publish: consumers must be between 1 and 65536")
        if next_arena < 0:
            raise BadRequest("publish: next_arena must be a size in bytes, or 0")
        ident = (_check_name("namespace", namespace), _check_name("key", key))
        session.access.check(namespace, True, "publish")
        layout, span = _buffer_layout(buffers, meta)
        pool, ps = ar.pool, ar.pool.page_size
        npages = max(1, -(-span // ps))
        if npages > ar.npages:
            raise BadRequest(f"publish: {span} bytes do not fit arena {arena} "
                             f"({ar.npages * ps} bytes); reserve instead")  # fmt: skip
        if ident in self.pending:
            raise Exists(f"{namespace}/{key} is being published by another writer")
        if ident in self.objects and not replace:
            raise Exists(f"{namespace}/{key} is already published")
        base = ar.start * ps
        obj = StoredObject(
            ident[0], ident[1], pool, ar.start, npages, sum(n for _, n in layout.values()),
            {name: (base + off, n) for name, (off, n) in layout.items()}, meta,
            next(self._serials),
        )  # fmt: skip
        self._accept_checksums(obj, checksums)
        obj.consumers = consumers
        obj.charged = self._charge(ident[0], npages * ps)

        # Everything is checked: the arena's first pages become the object.
        owners = self._owners[pool.index]
        if npages < ar.npages:
            ar.start = pool.allocator.split(ar.start, ar.npages, npages)
            ar.npages -= npages
            owners[ar.start] = ("w", ar.npages)
        else:
            del self.arenas[ar.id], session.arenas[ar.id]
            self._ended[ar.id] = "it was published whole"
            ar = None
        owners[obj.start] = obj
        # Keep what is left while it is at least half the size asked for: a fresh arena
        # every few publishes amortises its allocation, and the rest is never tiny.
        wanted = min(next_arena, pool.size // _ARENA_POOL_FRACTION)
        if ar is not None and 2 * ar.npages * ps < wanted:
            self._end_arena(ar, "it was used up; a fresh arena replaced it")
            ar = None
        if next_arena and ar is None:
            # Before the object is linked, so making room for the arena cannot evict it.
            try:
                ar = self._new_arena(session, next_arena)
            except PoolFull:
                ar = None  # the client falls back to reserve + seal
        elif not next_arena and ar is not None:
            self._end_arena(ar, "its holder asked for no further arena")
            ar = None
        reply = self._link_sealed(session, obj)
        reply["lease"] = None if ar is None else ar.id
        reply["arena"] = None if ar is None else ar.extent()
        return reply

    def _op_abort(self, session, lease) -> dict:
        if lease in self.arenas:
            self._end_arena(self._arena(session, lease), "it was aborted")
            return {}
        ls = self._lease(session, lease, "write")
        self._discard_pending(ls, quarantine=False)
        self._end_lease(ls, "it was aborted")
        self.counters["aborts"] += 1
        return {}

    # ------------------------------------------------------------------ claim
    def _op_claim(self, session, namespace, key, select, consume, wait, ttl) -> dict:
        # A consume-claim frees the object when released: as much a write as evict is.
        session.access.check(namespace, bool(consume), "consume-claim" if consume else "claim")
        ident = (namespace, key)
        obj = self.objects.get(ident)
        if obj is None:
            if wait is not None and wait > 0:
                raise WouldWait(ident, float(wait))
            self.counters["misses"] += 1
            raise NotFound(f"{namespace}/{key} is not published")
        if select is None:
            chosen = obj.buffers
        else:
            pattern = self._regex(select)
            chosen = {n: e for n, e in obj.buffers.items() if pattern.fullmatch(n)}
        ttl = self._ttl(ttl)
        self._check_lease_limit(session)
        self._pin(obj)
        lease = self._new_lease("read", session, obj, ttl, consume=consume)
        nbytes = sum(n for _, n in chosen.values())
        self.counters["claims"] += 1
        self.counters["hits"] += 1
        self.counters["bytes_out"] += nbytes
        session.bytes_claimed += nbytes
        self._record("claim", session, obj, nbytes)
        sums = obj.checksums
        return {
            "lease": lease.id,
            "ttl": ttl,
            "meta": obj.meta,
            "buffers": _extents(obj, chosen),
            "checksums": None if sums is None else {n: sums[n] for n in chosen},
        }

    def _op_release(self, session, lease, consume=True) -> dict:
        ls = self._lease(session, lease, "read")
        self._end_read(ls, "it was released", consume=ls.consume and consume)
        return {}

    def _op_release_many(self, session, leases) -> dict:
        for lid in leases:
            if not isinstance(lid, int) or isinstance(lid, bool):
                raise BadRequest("release_many: leases must be a list of lease ids")
            self._op_release(session, lid)
        return {}

    def _op_match_prefix(self, session, namespace, keys, block_tokens, ttl) -> dict:
        ttl = self._ttl(ttl)
        if len(keys) > MAX_BUFFERS:
            raise BadRequest(f"match_prefix: at most {MAX_BUFFERS} keys per request")
        if not session.access.can(namespace):  # another tenant's prefixes: invisible
            keys = ()
        objects = self.objects
        found = []
        for key in keys:
            obj = objects.get((namespace, key)) if key.__class__ is str else None
            if obj is None:
                break
            found.append(obj)
        c = self.counters
        c["prefix_queries"] += 1
        c["prefix_hit_blocks"] += len(found)
        c["prefix_miss_blocks"] += len(keys) - len(found)
        c["prefix_hit_tokens"] += len(found) * block_tokens
        c["hits" if found else "misses"] += 1
        if not found:
            return {"ttl": ttl, "matched": 0, "lease": None, "names": [], "blocks": []}
        self._check_lease_limit(session)
        # Compact reply: when every block has the same buffer names (the usual case), one
        # bytes string `packed` of little-endian int64 rows [pool, offset, nbytes, offset,
        # nbytes, ...] in the order of `names`, a row per block, each cached on its object (a
        # hot prefix is matched again and again); otherwise `blocks`, one extents map each.
        now = time.time()
        lru_pop = self._lru.pop
        names = found[0].compact_extents()[0]
        rows = []
        nbytes = 0
        for obj in found:  # pins each block (as _pin does, inline: this loop is per block)
            obj.readers += 1
            obj.last_access = now
            lru_pop(obj.serial, None)
            shape, row = obj.extents or obj.compact_extents()
            if shape != names:
                rows = None
            elif rows is not None:
                rows.append(row)
            nbytes += obj.nbytes
        lease = self._new_lease("read", session, found[0], ttl)
        lease.more = tuple(found[1:])
        c["bytes_out"] += nbytes
        session.bytes_claimed += nbytes
        reply = {"ttl": ttl, "matched": len(found), "lease": lease.id, "names": list(names),
                 "metas": [found[0].meta]}  # fmt: skip
        if rows is not None:
            reply["packed"], reply["blocks"] = b"".join(rows), []
        else:
            reply["blocks"] = [_extents(obj, obj.buffers) for obj in found]
        return reply

    def _op_renew(self, session, leases, ttl) -> dict:
        out = []
        for lid in leases:
            if not isinstance(lid, int) or isinstance(lid, bool):
                raise BadRequest("renew: leases must be a list of lease ids")
            ls = self._lease(session, lid, None)
            ls.ttl = self._ttl(ttl) if ttl is not None else ls.ttl
            ls.expires_at = self.clock() + ls.ttl
            heapq.heappush(self._expiry, (ls.expires_at, ls.id))
            out.append([lid, ls.ttl])
        return {"expires_in": out}

    # ------------------------------------------------------------------ directory
    def _op_lookup(self, session, namespace, key) -> dict | None:
        obj = self.objects.get((namespace, key))
        if obj is None or not session.access.can(namespace):
            return None
        info = obj.info()
        info["checksums"] = obj.checksums
        return info

    def _op_list(self, session, namespace, match, limit) -> dict:
        limit = _MAX_LIST if limit is None else max(0, min(limit, _MAX_LIST))
        pattern = self._regex(match) if match is not None else None
        out, truncated = [], False
        can = session.access.can
        for obj in self.objects.values():
            if namespace is not None and obj.namespace != namespace:
                continue
            if not can(obj.namespace):
                continue
            if pattern is not None and not pattern.search(obj.key):
                continue
            if len(out) == limit:
                truncated = True
                break
            out.append(obj.info())
        return {"objects": out, "truncated": truncated}

    def _op_evict(self, session, namespace, key, match, match_buffers, older_than, all, dry_run):
        if not (all or key is not None or match is not None or match_buffers is not None
                or older_than is not None or namespace is not None):  # fmt: skip
            raise BadRequest("evict: name what to evict (key, match, namespace, ...) or all")
        key_re = self._regex(match) if match is not None else None
        buf_re = self._regex(match_buffers) if match_buffers is not None else None
        access = session.access
        if namespace is not None and access.can(namespace):
            access.check(namespace, True, "evict")  # readable but not writable: say so
        now = time.time()
        victims, skipped = [], 0
        candidates = (
            [o for o in (self.objects.get((ns, key)) for ns in self._namespaces(namespace)) if o]
            if key is not None
            else list(self.objects.values())
        )
        for obj in candidates:
            if namespace is not None and obj.namespace != namespace:
                continue
            if not access.can(obj.namespace, write=True):
                continue  # another tenant's (or read-only shared) objects are not ours to free
            if key_re is not None and not key_re.search(obj.key):
                continue
            if buf_re is not None and not any(buf_re.search(b) for b in obj.buffers):
                continue
            if older_than is not None and now - obj.created_at < older_than:
                continue
            if obj.readers:
                skipped += 1
                continue
            victims.append(obj)
        victims, kept_parents = _leaves_first(victims)
        reported = [o.info() for o in victims[:_MAX_LIST]]
        nbytes = sum(o.nbytes for o in victims)
        if not dry_run:
            for obj in victims:
                self._evict(obj)
        return {
            "evicted": reported,
            "count": len(victims),
            "bytes": nbytes,
            "skipped_leased": skipped,
            "skipped_parents": kept_parents,
            "dry_run": dry_run,
        }

    def _namespaces(self, namespace: str | None):
        if namespace is not None:
            return (namespace,)
        return {ns for ns, _ in self.objects}

    def _op_stat(self, session) -> dict:
        return self.snapshot_for(session)

    def snapshot_for(self, session: Session, occupancy_cells: int = 64) -> dict[str, Any]:
        """A snapshot as this connection may see it: under a tenant policy, the names of
        namespaces it cannot read (their objects, leases, transfers, usage) and other users'
        connections are left out; pool-wide figures and counters stay."""
        snap = self.snapshot(occupancy_cells)
        access = session.access
        if access.admin:
            return snap
        can = access.can
        snap["objects"] = sum(1 for ns, _ in self.objects if can(ns))
        snap["pending"] = sum(1 for ns, _ in self.pending if can(ns))
        snap["leases"] = [x for x in snap["leases"] if can(x["namespace"])]
        snap["transfers"] = [x for x in snap["transfers"] if can(x["namespace"])]
        snap["clients"] = [c for c in snap["clients"] if c["uid"] == session.uid]
        snap["namespaces"] = [x for x in snap.get("namespaces", ()) if can(x["namespace"])]
        return snap

    def _op_watch(self, session, interval) -> dict:
        # The daemon schedules the pushes; the broker only validates.
        if interval < 0 or (0 < interval < 0.05):
            raise BadRequest("watch: interval must be 0 (stop) or at least 0.05 s")
        return {"interval": interval}

    # ------------------------------------------------------------------ expiry
    def expire(self, now: float | None = None) -> int:
        """End every lease whose TTL passed, and free the timed quarantine whose deadline
        passed; returns how many leases ended."""
        now = self.clock() if now is None else now
        held = self._held
        while held and held[0][0] <= now:
            _, idx, start, npages, charges = heapq.heappop(held)
            self._free_extent(self.pools[idx], start, npages)
            for namespace, charged in charges:
                self._uncharge(namespace, charged)
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
                self._discard_pending(ls, quarantine=True)
                self._end_lease(ls, reason)
            else:
                self._end_read(ls, reason, consume=False)
            self.counters["expired_leases"] += 1
            ended += 1
        return ended

    # ------------------------------------------------------------------ statistics
    def snapshot(self, occupancy_cells: int = 64) -> dict[str, Any]:
        now_wall, now = time.time(), self.clock()
        per_pool = [
            {"read": 0, "write": 0, "objects": 0, "quarantined": 0} for _ in self.pools
        ]
        for obj in self.objects.values():
            per_pool[obj.pool.index]["objects"] += 1
        for ls in self.leases.values():
            if ls.kind == "write":
                per_pool[ls.obj.pool.index]["write"] += ls.obj.npages
        for obj in self._pinned_objects():
            per_pool[obj.pool.index]["read"] += obj.npages
        for s in self.sessions.values():
            for pool, _, npages in s.quarantine:
                per_pool[pool.index]["quarantined"] += npages
        for _, idx, _, npages, _ in self._held:
            per_pool[idx]["quarantined"] += npages
        for arena in self.arenas.values():  # lent for writing, like a reservation
            per_pool[arena.pool.index]["write"] += arena.npages
        pools = []
        for p, acc in zip(self.pools, per_pool):
            a, ps = p.allocator, p.page_size
            pools.append({
                "index": p.index, "name": p.name, "capacity": p.size, "page_size": ps,
                "used": a.used * ps, "free": a.free * ps,
                "leased_read": acc["read"] * ps, "leased_write": acc["write"] * ps,
                "quarantined": acc["quarantined"] * ps, "objects": acc["objects"],
                "largest_free": a.largest_free * ps, "fragmentation": a.fragmentation,
                "high_watermark": self.high_watermark, "low_watermark": self.low_watermark,
                "occupancy": self._occupancy(p, occupancy_cells) if occupancy_cells else "",
            })  # fmt: skip
        clients = []
        for s in self.sessions.values():
            reads = sum(1 for ls in s.leases.values() if ls.kind == "read")
            clients.append({
                "session": s.id, "pid": s.pid, "uid": s.uid, "gid": s.gid, "name": s.name,
                "role": s.role, "connected_at": s.connected_at, "read_leases": reads,
                "write_leases": len(s.leases) - reads, "bytes_published": s.bytes_published,
                "bytes_claimed": s.bytes_claimed,
            })  # fmt: skip
        leases = [
            {"lease": ls.id, "kind": ls.kind, "session": ls.session.id,
             "namespace": ls.obj.namespace, "key": ls.obj.key,
             "nbytes": sum(o.nbytes for o in ls.objects()),
             "expires_in": ls.expires_at - now}
            for ls in list(self.leases.values())[-_MAX_REPORTED_LEASES:]
        ]  # fmt: skip
        reads = sum(1 for ls in self.leases.values() if ls.kind == "read")
        return {
            "taken_at": now_wall,
            "version": __version__,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "socket": self.socket_path,
            "objects": len(self.objects),
            "pending": len(self.pending),
            "read_leases": reads,
            "write_leases": len(self.leases) - reads,
            "arenas": len(self.arenas),
            "pools": pools,
            "clients": clients,
            "counters": dict(self.counters),
            "leases": leases,
            "transfers": list(self.transfers),
            "namespaces": self._namespace_usage(),
            "rings": self.rings.snapshot(occupancy_cells) if self.rings is not None else [],
        }

    def _pinned_objects(self):
        seen = set()
        for ls in self.leases.values():
            if ls.kind != "read":
                continue
            for obj in ls.objects():
                if obj.serial not in seen:
                    seen.add(obj.serial)
                    yield obj

    def _occupancy(self, pool: HostPool, cells: int) -> str:
        npages = pool.allocator.capacity
        cells = max(1, min(cells, npages))
        rank = {".": 0, "s": 1, "r": 2, "w": 3, "q": 4}
        out = ["."] * cells
        for start, owner in self._owners[pool.index].items():
            if isinstance(owner, tuple):
                state, length = owner
            else:
                length = owner.npages
                state = "w" if not owner.sealed else ("r" if owner.readers else "s")
            first, last = start * cells // npages, (start + length - 1) * cells // npages
            for c in range(first, last + 1):
                if rank[state] > rank[out[c]]:
                    out[c] = state
        return "".join(out)

    # ------------------------------------------------------------------ internals
    def _ttl(self, ttl: float | None) -> float:
        if ttl is None:
            return self.lease_ttl
        if not 0 < ttl <= self.max_lease_ttl:
            raise BadRequest(f"ttl must be in (0, {self.max_lease_ttl:g}] seconds")
        return float(ttl)

    def _regex(self, text: str) -> re.Pattern:
        pattern = self._regex_cache.get(text)
        if pattern is None:
            if len(text) > _MAX_REGEX:
                raise BadRequest(f"regex longer than {_MAX_REGEX} characters")
            try:
                # RE2 matches in linear time: a client's pattern cannot stall the daemon
                # (Python's re backtracks: "(a+)+$" against 40 a's runs for hours).
                pattern = re2.compile(text, options=_RE2_OPTIONS)
            except re2.error as exc:
                reason = exc.args[0] if exc.args else exc
                if isinstance(reason, bytes):
                    reason = reason.decode(errors="replace")
                raise BadRequest(f"bad regex {text!r}: {reason}") from None
            if len(self._regex_cache) > 256:
                self._regex_cache.clear()
            self._regex_cache[text] = pattern
        return pattern

    def _new_lease(self, kind, session, obj, ttl, consume=False) -> Lease:
        ls = Lease(self._next_id(), kind, session, obj, ttl, self.clock() + ttl, consume)
        self.leases[ls.id] = ls
        session.leases[ls.id] = ls
        heapq.heappush(self._expiry, (ls.expires_at, ls.id))
        return ls

    def _next_id(self) -> int:
        lid = next(self._ids)
        if lid >= self._id_limit:  # once per block of ids: a restart must not reuse them
            self._id_limit = self.journal.reserve_ids(lid)
        return lid

    def _lease(self, session: Session, lid: int, kind: str | None) -> Lease:
        ls = self.leases.get(lid)
        if ls is None:
            reason = self._ended.get(lid)
            if reason is not None:
                raise LeaseExpired(f"lease {lid} has ended: {reason}")
            if 0 < lid < self._first_id:
                raise LeaseExpired(
                    f"lease {lid} has ended: it died with the previous daemon, which restarted "
                    f"(this is epoch {self.epoch})"
                )
            raise BadRequest(f"no lease {lid}")
        if ls.session is not session:
            raise Forbidden(f"lease {lid} is held by another connection")
        if kind is not None and ls.kind != kind:
            raise BadRequest(f"lease {lid} is a {ls.kind} lease, not a {kind} lease")
        return ls

    def _end_lease(self, ls: Lease, reason: str) -> None:
        del self.leases[ls.id]
        ls.session.leases.pop(ls.id, None)
        self._ended[ls.id] = reason
        if len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)

    def _end_read(self, ls: Lease, reason: str, consume: bool) -> None:
        self._end_lease(ls, reason)
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

    def _pin(self, obj: StoredObject, now: float | None = None) -> None:
        obj.readers += 1
        obj.last_access = time.time() if now is None else now
        self._lru.pop(obj.serial, None)

    def _discard_pending(self, ls: Lease, quarantine: bool) -> None:
        obj = ls.obj
        del self.pending[(obj.namespace, obj.key)]
        if quarantine:
            # The pages stay charged to the namespace until the writer's connection ends.
            ls.session.quarantine_charges.append((obj.namespace, obj.charged))
            obj.charged = 0
            self._owners[obj.pool.index][obj.start] = ("q", obj.npages)
            ls.session.quarantine.append((obj.pool, obj.start, obj.npages))
        else:
            self._free_object(obj)

    def _unlink(self, obj: StoredObject) -> None:
        """Make an object unreachable; its extents go once no reader holds them."""
        if not obj.linked:
            return
        obj.linked = False
        if self.journal is not None:
            self.journal.unlinked(obj.serial)
        del self.objects[(obj.namespace, obj.key)]
        self._lru.pop(obj.serial, None)
        parent, obj.parent = obj.parent, None
        if parent is not None and parent.linked:
            parent.children -= 1
            if parent.children == 0 and parent.readers == 0:
                # Oldest end: the chain keeps shrinking from its leaf under pressure.
                self._lru[parent.serial] = parent
                self._lru.move_to_end(parent.serial, last=False)
        if obj.readers == 0:
            self._free_object(obj)

    def _evict(self, obj: StoredObject) -> None:
        assert obj.readers == 0 and obj.sealed and obj.children == 0
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += obj.nbytes
        self._unlink(obj)

    def _free_object(self, obj: StoredObject) -> None:
        self._owners[obj.pool.index].pop(obj.start, None)
        obj.pool.allocator.free_extent(obj.start, obj.npages)
        if not obj.sealed and self.journal is not None:  # a reservation's pages came back
            self.journal.returned(obj.pool.index, obj.start)
        if obj.charged:
            self._uncharge(obj.namespace, obj.charged)
            obj.charged = 0

    # ------------------------------------------------------------------ quotas, limits
    def _charge(self, namespace: str, nbytes: int, enforce: bool = True) -> int:
        """Count ``nbytes`` against ``namespace``; over its quota, evict that namespace's own
        least recently used unleased objects first, then raise QuotaExceeded. Returns the
        bytes charged (the caller stores them on the object, freeing uncharges them)."""
        used = self._usage.get(namespace, 0)
        limit = self.quotas.limit(namespace) if enforce and self.quotas else None
        if limit is not None and used + nbytes > limit:
            mine = [o for o in self._lru.values() if o.namespace == namespace]
            evictable = sum(o.charged for o in mine)
            if used - evictable + nbytes > limit:
                raise QuotaExceeded(
                    f"namespace {namespace!r}: {nbytes} more bytes would make {used + nbytes} "
                    f"of its quota of {limit} ({used} used, {evictable} of them evictable); "
                    "free some (release leases, evict) or raise [quotas]"
                )
            for obj in mine:
                if self._usage.get(namespace, 0) + nbytes <= limit:
                    break
                self._evict(obj)
            used = self._usage.get(namespace, 0)
        self._usage[namespace] = used + nbytes
        return nbytes

    def _uncharge(self, namespace: str, nbytes: int) -> None:
        left = self._usage.get(namespace, 0) - nbytes
        if left > 0:
            self._usage[namespace] = left
        else:
            self._usage.pop(namespace, None)

    def _check_lease_limit(self, session: Session) -> None:
        if len(session.leases) >= self.max_leases_per_client:
            raise LimitExceeded(
                f"session {session.id} ({session.name or 'pid ' + str(session.pid)}) holds "
                f"{len(session.leases)} leases, the most one connection may hold "
                "(max_leases_per_client): release some first"
            )

    def _namespace_usage(self, top: int = _MAX_NAMESPACES) -> list[dict[str, Any]]:
        """Per namespace: sealed objects, their bytes, bytes charged, quota (largest first)."""
        per: dict[str, list[int]] = {}
        for (ns, _), obj in self.objects.items():
            acc = per.setdefault(ns, [0, 0])
            acc[0] += 1
            acc[1] += obj.nbytes
        names = set(per) | set(self._usage)
        rows = [{"namespace": ns, "objects": per.get(ns, (0, 0))[0],
                 "bytes": per.get(ns, (0, 0))[1], "used": self._usage.get(ns, 0),
                 "quota": self.quotas.limit(ns)} for ns in names]  # fmt: skip
        rows.sort(key=lambda r: (-r["used"], r["namespace"]))
        return rows[:top]

    def _hold(self, pool: HostPool, start: int, npages: int,
              charges: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        """Put pages a writer may still be copying into in the timed quarantine: used, not
        allocatable, freed (and ``charges`` uncharged) by ``expire`` after the deadline."""
        self._owners[pool.index][start] = ("q", npages)
        deadline = self.clock() + self.restart_quarantine
        heapq.heappush(self._held, (deadline, pool.index, start, npages, charges))

    def _free_extent(self, pool: HostPool, start: int, npages: int) -> None:
        self._owners[pool.index].pop(start, None)
        pool.allocator.free_extent(start, npages)

    def _allocate(self, nbytes: int, *, evict: bool = True) -> tuple[HostPool, int, int]:
        if len(self.pools) == 1:  # the common case, on the hot path of every publish
            pool = self.pools[0]
            npages = -(-nbytes // pool.page_size)
            start = pool.allocator.alloc(npages) if nbytes <= pool.size else None
            if start is not None:
                return pool, start, npages
        fits = [p for p in self.pools if nbytes <= p.size]
        if not fits:
            biggest = max(p.size for p in self.pools)
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
        while True:
            victim = next((o for o in self._lru.values() if o.pool.index in feasible), None)
            if victim is None:
                raise PoolFull(f"no room for {nbytes} bytes even after eviction (fragmented)")
            pool = victim.pool
            self._evict(victim)
            npages = -(-nbytes // pool.page_size)
            start = pool.allocator.alloc(npages)
            if start is not None:
                return pool, start, npages

    def _enforce_watermark(self, pool: HostPool) -> None:
        a = pool.allocator
        if a.used <= self.high_watermark * a.capacity:
            return
        target = self.low_watermark * a.capacity
        for obj in [o for o in self._lru.values() if o.pool is pool]:
            if a.used <= target:
                break
            self._evict(obj)

    def _record(self, op: str, session: Session, obj: StoredObject, nbytes: int) -> None:
        self.transfers.append({
            "at": time.time(), "op": op, "session": session.id,
            "namespace": obj.namespace, "key": obj.key, "nbytes": nbytes,
        })  # fmt: skip


def _buffer_layout(buffers: dict, meta: dict | None) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of the named buffers inside one extent (aligned), and the extent's span."""
    if not buffers:
        raise BadRequest("reserve: an object needs at least one buffer")
    if len(buffers) > MAX_BUFFERS:
        raise BadRequest(f"reserve: at most {MAX_BUFFERS} buffers per object")
    if meta is not None and len(msgpack.packb(meta)) > MAX_META:
        raise BadRequest(f"reserve: meta must pack to at most {MAX_META} bytes")
    for name, nbytes in buffers.items():
        if not isinstance(name, str):
            raise BadRequest("reserve: buffer names must be strings")
        _check_name("buffer name", name)
        check_buffer_name(name)  # malformed KV names would never match a claim
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise BadRequest(f"reserve: size of buffer {name!r} must be a non-negative int")
    offsets, span = buffer_offsets(buffers)
    return {name: (offsets[name], nbytes) for name, nbytes in buffers.items()}, span


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


def _leaves_first(victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
    """Order victims so children go before parents; keep parents whose children stay.

    Returns the ordered victims and how many were kept for having children outside the batch.
    """
    chosen = {o.serial: o for o in victims}
    children_left = {o.serial: o.children for o in victims}
    ready = [o for o in victims if o.children == 0]
    ordered = []
    while ready:
        o = ready.pop()
        ordered.append(o)
        p = o.parent
        if p is not None and p.serial in chosen:
            children_left[p.serial] -= 1
            if children_left[p.serial] == 0:
                ready.append(p)
    return ordered, len(victims) - len(ordered)


def _check_name(what: str, value: str) -> str:
    if not value:
        raise BadRequest(f"{what} must not be empty")
    if len(value) > MAX_NAME:
        raise BadRequest(f"{what} longer than {MAX_NAME} characters")
    return value


def _extents(obj: StoredObject, chosen: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    idx = obj.pool.index
    return {name: [idx, off, n] for name, (off, n) in chosen.items()}
