"""The synchronous client: the facade engines and tools use.

One :class:`Client` is one connection to the daemon (reconnected after a break), the pools
it maps, and the calls engines make: publish (``reserve``, ``put``), claim (``claim``,
``get``), the directory and statistics. What a lease lends and when it ends:
:mod:`kvbroker._client.leases`. The requests themselves: :mod:`kvbroker._wire.ops`
(``client.ops``). ``put`` and ``get`` copy each byte exactly once. Pools are mapped once per
process and shared by every client in it (:mod:`kvbroker._client.mappings`). See
``docs/design.md``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from .directory_ops import PEER_GRACE, DirectoryOps, EvictResult, Listing
from .framing import MessageStream
from .._wire.paths import default_socket_path
from .leases import ReadLease, WriteLease
from .mappings import ClientMappings
from .pool_access import PoolAccess
from .mappings import process_maps as _process_maps  # noqa: F401  (tests count its holders)
from .ops import LEASE_OPS as _LEASE_OPS
from .ops import Ops
from .session import Session
from .._wire.protocol import MAX_REQUEST, seal_size
from .._wire.stats import Statistics
from .arena import WriteArena
from .block_ops import retention
from .replica import ASK_DAEMON, ReadReplica, answers
from .copy import copy_into, get_destinations, nbytes_of
from .engine import default_engine
from .transport import DEFAULT_BUSY_POLL, UnixTransport
from . import integrity as _integrity
from .._wire import checksum as _cs
from ..errors import BadRequest, BrokerUnavailable, Exists, Forbidden, LeaseExpired
from ..errors import KVBrokerError, PoolFull, QuotaExceeded, Timeout


__all__ = ["Client", "WriteLease", "ReadLease", "EvictResult", "Listing"]

log = logging.getLogger("kvbroker.client")


class Client(PoolAccess, DirectoryOps):
    """A connection to the node's kvbroker daemon.

    ``socket_path`` None means ``$KVBROKER_SOCKET`` or the default path. ``map_pools`` maps
    (and pre-faults) every pool at connect, as an engine wants; tools that only look at the
    daemon pass False and never touch the pools. ``busy_poll``: seconds to poll for a reply
    before sleeping, while the host has a CPU to spare (lower latency for a little CPU; 0
    turns it off). ``arena_size``: bytes
    of the write arena this client holds so that a put of up to half of it is one round
    trip (0: every put reserves, then seals). ``arena_max``: what the arena may grow to,
    doubling, for bigger puts (the daemon lends at most 1/16 of a pool; growth is undone after
    a run of smaller puts; what it holds meanwhile: ``_client/arena.py``, "Growth"; at most
    ``arena_size``: no growth).

    ``reconnect``: when an established connection breaks (the daemon crashed or restarted),
    the next call reconnects by itself, retrying with exponential backoff for at most this
    many seconds (0: raise BrokerUnavailable at once). Pools are re-mapped if the new daemon
    names them differently. Leases die with their connection: using one afterwards raises
    LeaseExpired saying whether the daemon restarted; a call that was in flight is sent
    again on the new connection, unless it used a lease.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        name: str = "",
        role: str = "",
        timeout: float | None = 30.0,
        map_pools: bool = True,
        busy_poll: float = DEFAULT_BUSY_POLL,
        reconnect: float = 5.0,
        arena_size: int = 2 << 20,
        arena_max: int = 64 << 20,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self._timeout = timeout
        self._busy_poll = busy_poll
        self._name, self._role = name or _default_name(), role
        self._map_pools = map_pools
        self.reconnect = reconnect
        # Connections replaced after a break; a lease of an older one is dead.
        self.generation = 0
        self.restarts = 0  # of those, how many found a restarted daemon
        self._lost = ""  # why the last connection was replaced, for LeaseExpired messages
        self._reconnect_lock = threading.Lock()
        self.pools: list[dict] = []
        self._maps = ClientMappings()
        self._closed = False
        # The daemon's operations, typed (kvbroker._wire.ops): leases, the arena,
        # kvbroker.prefix and kvbroker.gpu make their requests through these.
        self.ops = Ops(self._request, self._post, self._submit)
        # Puts of objects up to half this size take one round trip (see _arena.py); 0: off.
        # Small on purpose: measured, a 2 MiB arena beats 8 MiB at 256 KiB-4 MiB puts (its
        # pages are reused while still in cache; big objects gain little from one round trip).
        # Bigger puts grow it up to arena_max (_arena.py, "Growth").
        self._arena = WriteArena(self, arena_size if map_pools else 0, arena_max)
        self._replica: ReadReplica | None = None
        self._connect()
        _clients.add(self)  # see _after_fork_in_child

    # -- plumbing --------------------------------------------------------------------------
    def _connect(self, generation: int = 0) -> None:
        """Open and greet a connection, (re-)map the pools the daemon names, and only then
        make it this client's connection number ``generation``.

        Other threads must never see the new session before the generation is bumped and
        the pools are mapped: a lease or arena they got on it would be stamped with the old
        generation (and die at once), or be addressed through old mappings after a cold
        restart. So everything is built first and ``self._session`` is assigned last, in one
        step; until then other threads see the old, broken session and wait in ``_recover``.
        """
        stream = MessageStream(UnixTransport(self.socket_path, self._timeout, self._busy_poll))
        try:
            session = Session(stream, name=self._name, role=self._role)
        except BaseException:
            stream.close()
            raise
        try:
            hello = session.hello
            if hello["pools"] != self.pools:  # a cold restart made new segments
                self._maps.release_all()
                self.pools = hello["pools"]
            if self._map_pools:
                for pool in self.pools:
                    if pool.get("hidden"):
                        continue  # another tenant's own pool: the daemon does not name it
                    try:
                        self._mapping(pool["index"])
                    except Forbidden:
                        pass  # another tenant's own pool: the kernel keeps it from us
        except BaseException:
            session.close()
            raise
        if generation:  # replacing a connection: say why, for LeaseExpired messages
            if hello["server_pid"] != self.server_pid or hello.get("epoch") != self.epoch:
                self.restarts += 1
                self._lost = (
                    f"the daemon restarted (pid {self.server_pid} -> "
                    f"{hello['server_pid']}, epoch {self.epoch} -> "
                    f"{hello.get('epoch')})"
                )
            else:
                self._lost = "the connection to the daemon was lost"
        self.session_id: int = hello["session"]
        self.server_pid: int = hello["server_pid"]
        self.epoch: int | None = hello.get("epoch")
        # The checksum kind this client seals with: 1 where the daemon lists it, else 0 (a
        # daemon from before kind 1 refuses [1, value]; kvbroker._wire.checksum.seal_kind).
        self.checksum_kinds: tuple[int, ...] = tuple(hello.get("checksum_kinds") or (0,))
        self.checksum_kind: int = _cs.seal_kind(hello.get("checksum_kinds"))
        self.generation = generation
        # The daemon's read replicas answer exists and match_prefix(hold=False) (replica.py).
        old_replica, paths = self._replica, hello.get("replicas") or []
        self._replica = (
            ReadReplica(paths, name=self._name, busy_poll=self._busy_poll) if paths else None
        )
        if old_replica is not None:
            old_replica.close()
        self._session = session  # publish: last

    def _call(self, op: str, **args: Any) -> Any:
        return self._request(op, args)

    def _request(self, op: str, args: dict[str, Any]) -> Any:
        replica = self._replica
        # Only once this connection's own one-way changes (a consume's release) are answered:
        # the daemon answers a read behind them in order; a replica could answer before them.
        if replica is not None and answers(op, args) and self._session.settled:
            result = replica.call(op, args)
            if result is not ASK_DAEMON:
                return result  # (else the daemon answers: one that names replicas has exists)
        session = self._session
        try:
            return session.request(op, args)
        except KVBrokerError:
            # broken: the transport failed, or the daemon hung up after saying why (an idle
            # connection closed): a new connection serves the call
            if not session.broken or not self._recover(session):
                raise  # a reply saying so (a draining daemon), or reconnecting is off
        if op in _LEASE_OPS:  # the lease went with the old connection
            raise LeaseExpired(self._lost_lease_message(args.get("lease")))
        return self._session.request(op, args)

    def _submit(self, op: str, args: dict[str, Any]) -> Any:
        """:meth:`Session.submit` (no resend after a reconnect: a pipelined batch belongs to
        the connection it was sent on, its caller sees the break in ``result``). A
        connection already known broken is replaced first, as the next call would."""
        session = self._session
        if session.broken and self._recover(session):
            if op in _LEASE_OPS:  # the lease went with the old connection
                raise LeaseExpired(self._lost_lease_message(args.get("lease")))
            session = self._session
        return session.submit(op, args)

    def _post(self, op: str, args: dict[str, Any]) -> None:
        session = self._session
        try:
            session.post(op, args)
        except BrokerUnavailable:
            if not session.broken or not self._recover(session):
                raise
            raise LeaseExpired(self._lost_lease_message(args.get("lease"))) from None

    def _recover(self, broken: Session) -> bool:
        """Replace the broken connection ``broken``, backing off exponentially for at most
        ``reconnect`` seconds. False when reconnecting is off; BrokerUnavailable when it
        keeps failing. True at once when another thread already replaced it."""
        if self.reconnect <= 0 or self._closed:
            return False
        with self._reconnect_lock:
            if self._session is not broken:
                return True  # another thread already reconnected
            broken.close()
            deadline = time.monotonic() + self.reconnect
            delay = 0.01
            while True:
                try:
                    self._connect(self.generation + 1)
                    break
                except (BrokerUnavailable, Timeout) as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BrokerUnavailable(
                            f"{exc.message}; gave up reconnecting after {self.reconnect:g} s"
                        ) from None
                    time.sleep(min(delay, left))
                    delay = min(delay * 2, 0.5)
            log.warning("reconnected to %s: %s", self.socket_path, self._lost)
            return True

    def _lost_lease_message(self, lease: Any) -> str:
        return f"lease {lease} died with its connection: {self._lost}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._replica is not None:
            self._replica.close()
        self._session.close()  # the daemon ends every lease of this connection
        self._maps.release_all()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- publish ---------------------------------------------------------------------------
    def reserve(
        self,
        key: str,
        sizes: Mapping[str, int],
        *,
        namespace: str = "default",
        meta: dict | None = None,
        replace: bool = False,
        ttl: float | None = None,
        consumers: int = 1,
        checksum: bool = True,
        session: str | None = None,
        retain: float | str | None = None,
        priority: int | None = None,
    ) -> WriteLease:
        """A write lease with one writable view per named buffer; raises Exists if published.

        ``consumers``: how many consume-claims must be released before the object is freed.
        ``checksum``: hash the buffers at seal so claimers can verify them (costs one extra
        read of the written bytes; False skips it, and a daemon with require_checksums then
        refuses the seal). ``session``, ``retain``, ``priority``: the session that retains
        the object once sealed, as :class:`kvbroker.prefix.PrefixCache` takes them (see
        ``docs/sessions.md``); on Exists it retains the object already published.
        """
        reply = self.ops.reserve(
            key,
            sizes,
            namespace=namespace,
            meta=meta,
            replace=replace,
            ttl=ttl,
            consumers=consumers,
            retain=retention(session, retain, priority),
        )
        return WriteLease(self, namespace, key, reply, checksum)

    def put(
        self,
        key: str,
        buffers: Mapping[str, Any],
        *,
        namespace: str = "default",
        meta: dict | None = None,
        replace: bool = False,
        ttl: float | None = None,
        consumers: int = 1,
        checksum: bool = True,
        session: str | None = None,
        retain: float | str | None = None,
        priority: int | None = None,
    ) -> bool:
        """Publish ``buffers`` (numpy arrays, torch CPU tensors or bytes-like) under ``key``.

        Copies each byte once into the pool, then seals. Returns False when the key is
        already published and ``replace`` is False; nothing is copied then, except for an
        object small enough for the write arena (half of ``arena_size``, or of ``arena_max``
        once bigger puts grew it), which is copied into this client's arena first and
        published in one round trip (see _arena.py). ``checksum``: hash each
        chunk right after copying it (still one pass over memory) and record the digests.
        ``session``, ``retain``, ``priority``: the session that retains the object (the one
        already published, when this returns False), as :meth:`reserve` takes them.
        """
        kept = retention(session, retain, priority)  # checked before anything is copied
        sizes = {name: nbytes_of(b) for name, b in buffers.items()}
        if checksum and len(sizes) > 128 and seal_size(sizes) > MAX_REQUEST:
            # Refused before anything is reserved or copied: the daemon reads no longer seal.
            raise BadRequest(
                f"put: the seal of {len(sizes)} buffers' names and checksums "
                f"packs to more than the {MAX_REQUEST} bytes a daemon reads; "
                "use fewer or shorter buffer names"
            )
        if self._arena.fits(sum(sizes.values()), namespace):
            done = self._arena.put(
                key,
                buffers,
                sizes,
                namespace=namespace,
                meta=meta,
                replace=replace,
                consumers=consumers,
                checksum=checksum,
                retain=kept,
            )
            if done is not None:
                return done
        for last in (False, True):
            try:
                lease = self.reserve(
                    key,
                    sizes,
                    namespace=namespace,
                    meta=meta,
                    replace=replace,
                    ttl=ttl,
                    consumers=consumers,
                    checksum=checksum,
                    session=session,
                    retain=retain,
                    priority=priority,
                )
                break
            except Exists:
                if replace:
                    raise
                return False
            except (PoolFull, QuotaExceeded):
                # Our own arena, grown for bigger puts, may hold the room: give it back and
                # ask once more (_arena.py, "Growth").
                if last or not self._arena.give_back_grown():
                    raise
        placed = next(iter(lease.extents().values()), None)
        if placed is not None:
            self._arena.placed(namespace, placed[0])
        with lease:
            if checksum:
                kind = self.checksum_kind
                lease.checksums = {
                    name: _integrity.copy_hashed(lease[name], src, copy_into, kind)
                    if sizes[name]
                    else _integrity.empty_digest(kind)
                    for name, src in buffers.items()
                }
            else:
                for name, src in buffers.items():
                    if sizes[name]:
                        copy_into(lease[name], src)
        return True

    # -- claim -----------------------------------------------------------------------------
    def claim(
        self,
        key: str,
        *,
        namespace: str = "default",
        select: str | None = None,
        consume: bool = False,
        wait: float | None = None,
        ttl: float | None = None,
        verify: bool = False,
        peer: str | None = None,
    ) -> ReadLease:
        """A read lease on a sealed object.

        ``select``: a regex that buffer names must match in full; ``consume``: free the
        object when this lease is released; ``wait``: seconds to wait for the key to be
        sealed (else NotFound at once; Timeout when the wait runs out). ``verify``: re-hash
        the buffers before returning (one read of them) and raise ChecksumMismatch, with the
        lease released, if any differs from its checksum recorded at seal.
        ``peer``: ``"HOST:PORT"`` of another node's broker; when this node lacks the object,
        its daemon pulls it from there first (one NIXL READ, checksums verified; a consume
        counts there) and the claim is then served here. Raises PeerUnavailable,
        TransferFailed or ChecksumMismatch (naming the peer) when the pull fails.
        """
        longer = (wait or 0) + (PEER_GRACE if peer is not None else 0)
        if longer and self._timeout is not None:
            self._session.settimeout(self._timeout + longer)
        asked_at = time.monotonic()
        try:
            reply = self.ops.claim(
                key,
                namespace=namespace,
                select=select,
                consume=consume,
                wait=wait,
                ttl=ttl,
                peer=peer,
            )
        finally:
            if longer and self._timeout is not None:
                self._session.settimeout(self._timeout)
        lease = ReadLease(self, namespace, key, reply, asked_at)
        if verify:
            try:
                lease.verify()
            except BaseException:
                lease.__exit__(*sys.exc_info())
                raise
        return lease

    def get(
        self,
        key: str,
        out: Mapping[str, Any] | None = None,
        *,
        namespace: str = "default",
        select: str | None = None,
        consume: bool = False,
        wait: float | None = None,
        verify: bool = False,
        peer: str | None = None,
    ) -> dict[str, Any]:
        """Claim, copy every selected buffer out once, release (``peer``: as in claim).
        Large buffers are copied by the host copy engine, over its threads.

        ``out`` maps buffer names to destinations (numpy arrays, torch tensors, writable
        bytes-like) of the right size, no two sharing memory; buffers not in ``out`` get fresh
        uint8 arrays.
        ``verify``: hash each chunk as it is copied out (still one pass) and raise
        ChecksumMismatch instead of returning bytes that differ from those sealed (the
        destinations in ``out`` then hold the bad bytes: do not use them).
        """
        engine = default_engine()
        # below two ranges' worth the engine would copy on this thread anyway: skip its set-up
        split_from = 2 * engine.split_min if engine.threads > 1 else None
        with self.claim(
            key, namespace=namespace, select=select, consume=consume, wait=wait, peer=peer
        ) as lease:
            # every destination checked before any byte is copied: a bad one loses nothing (an
            # exception here ends the lease without counting a consume: ReadLease.__exit__)
            targets, returned = get_destinations(lease, out, namespace, key, select)
            sums = lease.checksums if verify else None
            bad = []
            for name, target in targets.items():
                src = lease[name]
                if sums and name in sums:
                    if not _integrity.copy_out_checked(target, src, sums[name]):
                        bad.append(name)
                elif split_from is not None and src.nbytes >= split_from:
                    engine.copy(target, src)  # over the engine's threads, as put copies in
                else:
                    engine.copy_here(target, src)
            if bad:
                _integrity.check(namespace, key, bad)
        # the caller's destinations as given, fresh arrays for the buffers it named none for
        return returned

    # -- statistics ------------------------------------------------------------------------
    def stat(self) -> Statistics:
        return Statistics.from_dict(self.ops.stat())

    def watch(self, interval: float = 1.0) -> Iterator[Statistics]:
        """Snapshots pushed by the daemon every ``interval`` seconds, forever."""
        while True:
            self.ops.watch(interval)
            self._session.settimeout(max(30.0, interval * 10))
            session = self._session
            try:
                while True:
                    msg = session.next_push()
                    yield Statistics.from_dict(msg["result"])
            except BrokerUnavailable:
                if not session.broken or not self._recover(session):
                    raise  # else subscribe again on the new connection


def _default_name() -> str:
    import os

    return (
        f"{os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else 'python'}:{os.getpid()}"
    )


_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child (os.register_at_fork below), for every Client: locks a parent's
    thread may hold are replaced, the connection and the write arena (the parent's) are
    given up without touching them; the next call connects again from the child."""
    for client in list(_clients):
        client._reconnect_lock = threading.Lock()
        client._maps.after_fork()
        client._session.after_fork()
        client._arena.after_fork()
        if client._replica is not None:
            client._replica.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
