"""The daemon's state, and THE ownership contract: who owns and frees what.

This docstring is the one statement of the contract; other modules link here. The types
below are the state (:class:`Session`, :class:`StoredObject`, :class:`Lease`,
:class:`Arena`). Each part of it has one owner, a class that keeps it, makes its
transitions (each method says in one line what it owns and frees) and builds its own
``statistics()``: :class:`~kvbroker._server.directory.Directory` (objects by key and
namespace, reservations, the LRU, prefix links), :class:`~kvbroker._server.leases.LeaseTable`
(live pool leases, expiry, per-session and per-uid limits),
:class:`~kvbroker._server.pages.Pages` (placement, allocation, the occupancy map, the timed
quarantine), :class:`~kvbroker._server.accounts.Accounts` (quota charges),
:class:`~kvbroker._server.arenas.Arenas` (write arenas), the GPU rings
(:class:`~kvbroker._server.rings.RingService`) and the fleet
(:class:`~kvbroker._server.fleet.Fleet`). :class:`~kvbroker._server.transitions.Transitions`
(the broker's coordinating half) owns the sessions and makes the transitions that span
owners; :mod:`kvbroker._server.handlers` answers one op each. No I/O, no asyncio.

State × event
-------------

What becomes of an extent of pool pages (and who holds it) at each event; ``-``: the event
cannot reach it. *close*: the client closed its connection; *cut off*: the daemon did (its
writer may still be copying); *restart*: a warm restart adopts the pools.

================  =======  ===========  =======  =======  ============  ======  =======
state             seal     abort/close  TTL      cut off  last release  evict   restart
================  =======  ===========  =======  =======  ============  ======  =======
free              -        -            -        -        -             -       free
reserved          sealed   free         sess q.  timed q  -             -       timed q
sealed, unread    -        -            -        -        -             free    sealed
sealed, read      -        unread       unread   unread   unread [1]_   -       sealed
unlinked, read    -        free [2]_    free     free     free          -       free
arena             sealed   free         -        timed q  -             -       timed q
session q.        -        free         -        timed q  -             -       timed q
timed q.          -        -            free     -        -             -       timed q
================  =======  ===========  =======  =======  ============  ======  =======

.. [1] or unlinked (a consume-release bringing its consumers to 0): then freed if unread.
.. [2] "free" for a read object means: freed at its last reader's release.

Held by: *reserved*: ``Directory.pending``, a write lease of the ``LeaseTable``, the object
in ``Pages.owners``; *sealed*: ``Directory.objects`` (in its LRU while unread and childless);
*read*: read leases of the ``LeaseTable`` (the object's ``readers``); *unlinked, read*: its
readers only (freed at the last release: "free" above means at the last reader's); *arena*:
``Arenas``, ``("w", n)`` in ``Pages.owners``; *session q.*: the writer's
``Session.quarantine``, ``("q", n)``, still charged; *timed q.*: ``Pages``' deadlines,
``("q", n)``, freed (and uncharged) when due. An *arena*'s publish seals its first pages
and keeps the rest (or a fresh arena). A replacing seal unlinks the older object of its key.

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

*Restart quarantine* — pages lent for writing are journaled (:mod:`kvbroker._server.journal`, ``w`` records,
ended by the seal or an ``e`` record). A daemon adopting a dead one's pools puts the pages
still lent at the crash into the timed quarantine too: the writer may outlive the daemon and
finish its copy into pages a new owner would already hold. Quarantined pages count as used
and as ``quarantined`` in ``stat``; they are freed by the broker alone, at the deadline.

*Write arena* (``arena``, then ``publish``) — fresh pages lent to one session with no TTL, so
a put can be one round trip: the client copies into them first, then ``publish`` turns the
arena's first pages into a sealed object (the extent is split, nothing is copied) and the rest
stays the arena, or a fresh one replaces it (also when the rest is more than twice what the
client now asks for: a client whose arena grew for big puts asks small ones again). An arena
is freed by ``abort`` (the client's, also when a grown arena sat idle: ``_client/arena.py``),
by being published whole, or when its client closes the connection (its writer is gone: no
quarantine needed; if the daemon cut it off, it goes into the timed quarantine, see below). It
counts as used and write-leased, is never evicted, and is at most 1/16 of the pool it lies in;
all arenas together at most 1/4 of the pools.

*Read lease* (``claim``) — while held, the object's extents are neither evicted nor reused.
It ends on ``release``, on TTL expiry, or when the connection closes. A claim with
``consume`` counts down the object's ``consumers`` (set at reserve, default 1) when that lease
is released; at zero the object is unlinked, and its extents are freed once the last read
lease on it ends. A consumer that crashes before releasing does not count: the object stays
for a retry (or for eviction). A prefix match (``match_prefix``) is one read lease over all
its blocks; over a chain (or chains interleaved block by block) it counts as a reader of each
chain's last block only, which holds the others no less (:mod:`kvbroker._server.prefix_leases`
says why, and when it counts on each). A match with ``hold`` false takes no lease: it only
counts, and whoever asked owns nothing.

*Fencing* — lease ids are never reused. Using an ended lease raises
:class:`~kvbroker.errors.LeaseExpired` saying why it ended; a reader that gets it on
``release`` must assume what it read may have been overwritten.

*Eviction* — least recently used among sealed objects with no read lease, when a reservation
does not fit, or after a seal pushes a pool past its high watermark (down to the low one).
Leased and unsealed objects are never evicted. A reservation that cannot fit even after
evicting everything evictable fails at once with :class:`~kvbroker.errors.PoolFull`, and then
nothing is evicted for it. Objects a *session* retains (:mod:`kvbroker._server.retention`) are
kept out of the LRU and evicted only after every other evictable object, lowest priority then
least recently used; when its session ends (or a bound takes its retention) an object goes
back to the LRU's oldest end. Retention frees nothing and holds no lease.

*Lease ids* — one registry (:mod:`kvbroker._server.leases`) numbers sessions, pool leases,
write arenas and ring leases from one counter, fenced across warm restarts, and answers the
same errors for all: an ended lease :class:`~kvbroker.errors.LeaseExpired`, a lease of
another connection :class:`~kvbroker.errors.Forbidden`.

*GPU staging rings* (``serve --gpu-ring``, :mod:`kvbroker._server.rings`) — the daemon owns
each ring's device memory (``cuMemAlloc`` through the driver API; freed at shutdown) and its
allocator (:class:`~kvbroker._server.ring_allocator.RingAllocator`: strict FIFO recycling);
a client maps a ring once per process (``cuIpcOpenMemHandle``) and only ever borrows a
region through a *ring lease*, bound to its connection:

- ``ring_reserve`` without a key: *scratch* staging, freed by ``ring_release``; with a key:
  a ring-located object being published, made visible by ``ring_seal`` (the object then
  owns the region) or discarded by ``ring_release``;
- ``ring_claim``: a *read* lease on a sealed ring object; the region is not reused while it
  is held. With ``consume`` (the default: a GPU→GPU handoff is one-shot) the object is
  unlinked at once and freed when its last reader releases;
- a connection that closes ends every ring lease it holds: scratch and write regions are
  freed at once; a read lease ends without consuming (the object stays for a retry);
- a sealed ring object nobody claims within its ``ttl`` is freed: a ring is FIFO, so a
  forgotten object would hold back all space behind it.
"""

from __future__ import annotations

import struct
import sys
import time
from typing import Any

from .._wire.stats import ClientStatistics
from .policy import Access, Policy
from .pool import HostPool

__all__ = [
    "Session",
    "StoredObject",
    "Lease",
    "Arena",
    "WouldWait",
    "Deferred",
    "OPEN_POLICY",
    "index_footprint",
    "names_footprint",
    "value_footprint",
]

OPEN_POLICY = Policy()  # every namespace open to everyone: the default

# One tuple per distinct (buffer names, nbytes) (StoredObject.shape), up to _MAX_SHAPES of
# them; shapes past that keep their own tuple (equal, not identical: compared by value).
_SHAPES: dict[tuple[tuple[str, ...], int], tuple[tuple[str, ...], int]] = {}
_MAX_SHAPES = 4096


class WouldWait(Exception):
    """Raised by ``claim`` with ``wait``: the async layer retries after the key is sealed."""

    def __init__(self, key: tuple[str, str], timeout: float) -> None:
        self.key = key
        self.timeout = timeout


class Deferred(Exception):
    """Raised by a handler whose answer needs I/O first (a pull from a peer broker,
    :mod:`kvbroker._server.fleet`). The connection awaits ``work()`` (a coroutine) off the
    request path, for at most ``timeout`` seconds, then answers with ``then(result)`` run on
    the event loop; its later requests wait, in order, as behind a waiting claim (which
    releases pass, ``passes_a_wait`` in the op table; a deferred request they do not)."""

    def __init__(self, work: Any, then: Any, timeout: float) -> None:
        self.work = work
        self.then = then
        self.timeout = timeout


class Session:
    """One client connection, as the broker sees it."""

    __slots__ = (
        "id",
        "pid",
        "uid",
        "gid",
        "name",
        "role",
        "connected_at",
        "leases",
        "quarantine",
        "bytes_published",
        "bytes_claimed",
        "greeted",
        "arenas",
        "access",
        "quarantine_charges",
        "reported",
    )

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
        self.access: Access = OPEN_POLICY.access(uid, gid)  # what the policy lets it do
        self.bytes_published = 0
        self.bytes_claimed = 0
        self.reported: dict[str, int] = {}  # the client's own counters (the report op)
        self.greeted = False

    def statistics(self) -> ClientStatistics:
        reads = sum(1 for ls in self.leases.values() if ls.kind == "read")
        return ClientStatistics(
            session=self.id,
            pid=self.pid,
            uid=self.uid,
            gid=self.gid,
            name=self.name,
            role=self.role,
            connected_at=self.connected_at,
            read_leases=reads,
            write_leases=len(self.leases) - reads,
            bytes_published=self.bytes_published,
            bytes_claimed=self.bytes_claimed,
            reported=dict(self.reported),
        )


# An object's entry in the index beyond what index_footprint counts: the StoredObject, its
# buffers map and its place in the directory, the LRU and the journal's serials.
_ENTRY_BYTES = 512
_PER_BUFFER = 160  # a buffers map entry: its (offset, nbytes) tuple and two ints


def index_footprint(buffers: dict, meta: Any, tokens: list | None = None) -> int:
    """Bytes of daemon memory an object's index entry takes (estimated from above): its
    buffer names, its meta as unpacked, its token ids. An object occupies at least this many
    pool bytes (:meth:`Broker.reserve_extent`), so what clients make the daemon hold for
    their objects stays bounded by the pools, whatever the names and metas."""
    return names_footprint(buffers) + value_footprint(meta) + 36 * len(tokens or ())


def names_footprint(buffers: dict) -> int:
    """The entry's own cost and its buffers map's (a batch of objects of one layout pays
    for it once: see ``op_reserve_blocks``)."""
    total = _ENTRY_BYTES + _PER_BUFFER * len(buffers)
    for name in buffers:  # a str: its header, and 1 byte a character (ASCII) or up to 4
        total += 49 + len(name) if name.isascii() else 80 + 4 * len(name)
    return total


def value_footprint(value: Any) -> int:
    """Bytes a msgpack-decoded value takes here: containers, strings and numbers by
    ``sys.getsizeof``, shared objects (None, bools, small ints) by their pointer only."""
    total = 0
    stack = [value]
    while stack:
        value = stack.pop()
        total += 8  # the pointer to it
        cls = value.__class__
        if value is None or cls is bool or (cls is int and -5 <= value <= 256):
            continue
        total += sys.getsizeof(value)
        if cls is dict:
            stack.extend(value.keys())
            stack.extend(value.values())
        elif cls is list or cls is tuple:
            stack.extend(value)
    return total


class StoredObject:
    # What a prefix match reads of every block comes first: adjacent slots, one or two
    # cache lines per block (kvbroker._server.prefix_leases).
    __slots__ = (
        "parent",
        "shape",
        "row",
        "nbytes",
        "last_access",
        "readers",
        "children",
        "serial",
        "linked",
        "namespace",
        "key",
        "pool",
        "start",
        "npages",
        "buffers",
        "meta",
        "created_at",
        "sealed",
        "consumers",
        "parent_key",
        "checksums",
        "charged",
        "seq",
        "tokens",
        "tenants",
        "depth",
    )

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
        # Its parent's depth + 1 when linked (0 without one): a chain's blocks have
        # consecutive depths, so a lease over one finds a block at a known index.
        self.depth = 0
        # {buffer: xxh3_64} computed by the writer, recorded at seal (kvbroker._wire.checksum).
        self.checksums: dict[str, int] | None = None
        self.charged = 0  # bytes counted against its namespace's quota until freed
        # tenant accounts (("user", uid), ("group", gid)) charged ``charged`` bytes too
        self.tenants: tuple[tuple[str, int], ...] = ()
        self.shape: tuple[tuple[str, ...], int] | None = None  # see compact_extents
        self.row: bytes | None = None
        # Link order: set when linked into Broker.objects, rising along its iteration order
        # (the cursor of the ``list`` op). Not persisted: a restart renumbers in that order.
        self.seq = 0
        # A prefix block's token ids (reserve_blocks' ``tokens``): announced in KV events
        # (kvbroker._server.events) when sealed and when unlinked; None for other objects.
        self.tokens: list[int] | None = None

    def compact_extents(self) -> tuple[tuple[str, ...], bytes]:
        """(buffer names, little-endian int64 [pool, offset, nbytes, offset, nbytes, ...]),
        the form a prefix match replies in; built on first use and kept (buffers never move
        once reserved). Kept with ``shape``, (buffer names, nbytes): one tuple shared by
        every object of the same names and size, so a match compares blocks by identity."""
        if self.row is None:
            flat = [self.pool.index]
            for off, n in self.buffers.values():
                flat += (off, n)
            shape = (tuple(self.buffers), self.nbytes)
            shared = _SHAPES.get(shape)
            if shared is None:
                shared = shape
                if len(_SHAPES) < _MAX_SHAPES:  # bounded: names are the clients' choice
                    _SHAPES[shape] = shape
            self.shape, self.row = shared, struct.pack(f"<{len(flat)}q", *flat)
        return self.shape[0], self.row  # type: ignore[index,return-value]

    # The fields that survive a warm restart (kvbroker._server.journal). A new per-object field that a
    # restarted daemon must still know goes here; ``pool`` and ``parent`` travel as indices.
    PERSISTED = (
        "serial",
        "namespace",
        "key",
        "start",
        "npages",
        "nbytes",
        "meta",
        "created_at",
        "consumers",
        "parent_key",
        "checksums",
        "tokens",
        "tenants",
    )

    def to_record(self) -> dict[str, Any]:
        """This sealed object as a journal record (msgpack-able)."""
        # (spelled out: one record per publish, on the request's path; PERSISTED names the
        # same fields, tests/test_restart.py checks that they agree)
        parent = self.parent
        return {
            "serial": self.serial,
            "namespace": self.namespace,
            "key": self.key,
            "start": self.start,
            "npages": self.npages,
            "nbytes": self.nbytes,
            "meta": self.meta,
            "created_at": self.created_at,
            "consumers": self.consumers,
            "parent_key": self.parent_key,
            "checksums": self.checksums,
            "tokens": self.tokens,
            "tenants": self.tenants,
            "pool": self.pool.index,
            "buffers": self.buffers,
            "parent": None if parent is None else parent.serial,
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any], pools: list[HostPool]) -> StoredObject:
        """A sealed object back from its journal record; ``parent`` is resolved by the
        caller (it names a serial)."""
        buffers = {name: (int(off), int(n)) for name, (off, n) in rec["buffers"].items()}
        obj = cls(
            rec["namespace"],
            rec["key"],
            pools[rec["pool"]],
            rec["start"],
            rec["npages"],
            rec["nbytes"],
            buffers,
            rec["meta"],
            rec["serial"],
        )
        for name in cls.PERSISTED:
            if name in rec:
                setattr(obj, name, rec[name])
        obj.tenants = tuple((str(k), int(i)) for k, i in obj.tenants or ())
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
    __slots__ = ("id", "kind", "session", "obj", "more", "ttl", "expires_at", "consume", "lazy")

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
        # A prefix lease whose blocks form s chains interleaved block by block (s = 1: one
        # chain): s, and only its last s blocks count it as a reader
        # (kvbroker._server.prefix_leases says why that holds the others); 0: every block.
        self.lazy = 0

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

    __slots__ = ("id", "session", "pool", "start", "npages", "charged", "tenants")

    def __init__(self, aid: int, session: Session, pool: HostPool, start: int, npages: int):
        self.charged = 0  # bytes charged to its holder's tenant accounts
        self.tenants: tuple[tuple[str, int], ...] = ()
        self.id = aid
        self.session = session
        self.pool = pool
        self.start = start
        self.npages = npages

    def extent(self) -> list[int]:
        ps = self.pool.page_size
        return [self.pool.index, self.start * ps, self.npages * ps]
