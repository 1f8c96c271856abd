"""The synchronous client: the facade engines and tools use.

Ownership, from the client's side
---------------------------------

- A :class:`WriteLease` (``reserve``) lends you writable views of fresh extents. You own the
  writing; the broker owns the memory. ``seal`` publishes, ``abort`` discards. Leaving the
  ``with`` block seals, or aborts when it is left by an exception. After either, the views
  must not be touched: the extents belong to the object (or to the next owner).
- A :class:`ReadLease` (``claim``) lends you read-only views of a sealed object. They are
  valid until ``release`` (the end of the ``with`` block), TTL expiry or the connection
  closing. Copy out what you need to keep. ``release`` raising
  :class:`~kvbroker.errors.LeaseExpired` means the lease ended early and what you read may
  have been overwritten. A release well inside the lease's TTL is pipelined: it takes effect
  in the daemon before the client's next call is answered, and at the latest before
  ``close`` returns (which is when a consume-claim's freeing is visible to other clients).
- ``put`` and ``get`` do the above for you, copying each byte exactly once.
- Pools are mapped once per process and shared by every client in it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from .framing import MessageStream
from .._wire.paths import default_socket_path
from .._wire.protocol import LEASE_NAMING_OPS
from .mappings import PoolMapping
from .session import Session
from .shared import PerProcess
from .._wire.stats import ObjectInfo, Statistics
from .arena import WriteArena
from .copy import _np, _torch_tensor, copy_into, nbytes_of
from .transport import UnixTransport
from . import integrity as _integrity
from ..errors import BadRequest, BrokerUnavailable, Exists, KVBrokerError, LeaseExpired
from ..errors import ProtocolError, Timeout


__all__ = ["Client", "WriteLease", "ReadLease", "EvictResult"]

log = logging.getLogger("kvbroker.client")

# Requests that name a lease: after a reconnect they are not resent (the lease is gone).
_LEASE_OPS = LEASE_NAMING_OPS

# segment name -> this process's one mapping of it
_process_maps: PerProcess[PoolMapping] = PerProcess(PoolMapping.close)
_EMPTY_DIGEST = _integrity.digest(b"")


class _Lease:
    """Common part of read and write leases: views over extents, renew, context manager."""

    _writable = False

    def __init__(
        self, client: Client, namespace: str, key: str, reply: dict, asked_at: float = 0.0
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.key = key
        self.id: int = reply["lease"]
        self.ttl: float = reply["ttl"]
        self._extents: dict[str, list[int]] = reply["buffers"]
        self._views: dict[str, Any] = {}
        self.ended = False
        # The daemon started the TTL after we asked, so it cannot expire before this.
        self._safe_until = asked_at + 0.9 * self.ttl
        self._generation = client.generation  # the connection this lease lives and dies with

    def __getitem__(self, name: str):
        view = self._views.get(name)
        if view is None:
            if self.ended:
                raise KVBrokerError(f"lease {self.id} has ended; its views are gone")
            # After a reconnect the pools may be new segments: never map old extents there.
            self._check_alive()
            pool, offset, nbytes = self._extents[name]
            view = _np().frombuffer(
                self.client._mapping(pool).mm, dtype="uint8", count=nbytes, offset=offset
            )
            if not self._writable:
                view.flags.writeable = False
            self._views[name] = view
        return view

    def __contains__(self, name: str) -> bool:
        return name in self._extents

    def __iter__(self) -> Iterator[str]:
        return iter(self._extents)

    def __len__(self) -> int:
        return len(self._extents)

    def keys(self):
        return self._extents.keys()

    def items(self):
        return [(name, self[name]) for name in self._extents]

    @property
    def nbytes(self) -> int:
        return sum(e[2] for e in self._extents.values())

    def extents(self) -> dict[str, tuple[int, int, int]]:
        """``{name: (pool, offset, nbytes)}``: for DMA engines that address the pools directly."""
        return {n: tuple(e) for n, e in self._extents.items()}

    def renew(self, ttl: float | None = None) -> float:
        self._check_alive()
        asked_at = time.monotonic()
        ((_, granted),) = self.client._call("renew", leases=[self.id], ttl=ttl)["expires_in"]
        self.ttl = granted
        self._safe_until = asked_at + 0.9 * granted
        return granted

    def _drop_views(self) -> None:
        self.ended = True
        self._views.clear()

    def _check_alive(self) -> None:
        """Raise LeaseExpired for a lease of a connection the client has since replaced."""
        if self._generation != self.client.generation:
            self._drop_views()
            raise LeaseExpired(self.client._lost_lease_message(self.id))

    def __enter__(self):
        return self


class WriteLease(_Lease):
    """Writable views of a reservation; ``seal`` publishes it, ``abort`` discards it.

    With ``checksum`` (the default), ``seal`` hashes every buffer as written (one extra read
    of the bytes) and records the digests with the object, unless ``checksums`` was already
    set by whoever filled the views (``put`` hashes while copying).
    """

    _writable = True

    def __init__(self, client: Client, namespace: str, key: str, reply: dict,
                 checksum: bool = True) -> None:  # fmt: skip
        super().__init__(client, namespace, key, reply)
        self.checksum = checksum
        self.checksums: dict[str, int] | None = None

    def seal(self) -> None:
        self._check_alive()
        sums = self.checksums
        if sums is None and self.checksum and not self.ended:
            sums = {name: _integrity.digest(self[name]) for name in self._extents}
        self._drop_views()
        try:
            self.client._call("seal", lease=self.id, checksums=sums)
        except (BadRequest, ProtocolError):
            # Refused (bad or missing checksums...): the views are gone, so free the pages.
            try:
                self.client._call("abort", lease=self.id)
            except KVBrokerError:
                pass
            raise

    def abort(self) -> None:
        if not self.ended and self._generation != self.client.generation:
            self._drop_views()  # the reservation went with the old connection
        if not self.ended:
            self._drop_views()
            self.client._call("abort", lease=self.id)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.ended:
            return
        if exc_type is None:
            self.seal()
        else:
            try:
                self.abort()
            except KVBrokerError:
                pass  # the original exception matters more; the lease ends with the session


class ReadLease(_Lease):
    """Read-only views of a sealed object; valid until ``release``."""

    def __init__(
        self, client: Client, namespace: str, key: str, reply: dict, asked_at: float = 0.0
    ) -> None:
        super().__init__(client, namespace, key, reply, asked_at)
        self.meta: dict | None = reply.get("meta")
        # {buffer: xxh3_64} recorded at seal, for the buffers of this lease; None if the
        # writer sealed without checksums.
        self.checksums: dict[str, int] | None = reply.get("checksums")

    def verify(self) -> None:
        """Re-hash the leased buffers; raise ChecksumMismatch naming those that differ from
        the checksums recorded at seal (buffers sealed without one are not checked)."""
        if self.checksums:
            bad = _integrity.mismatched({n: self[n] for n in self._extents}, self.checksums)
            _integrity.check(self.namespace, self.key, bad)

    def release(self) -> None:
        """End the lease. Raises LeaseExpired if it had already ended (see the module doc)."""
        if self.ended:
            return
        self._check_alive()
        self._drop_views()
        if time.monotonic() < self._safe_until:
            # A read lease ends early only by TTL or by its connection closing: well inside
            # its TTL the release cannot fail, so its reply is checked by the next call.
            self.client._send_only("release", lease=self.id)
        else:
            self.client._call("release", lease=self.id)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.release()
        elif not self.ended:
            try:
                self.release()
            except KVBrokerError:
                pass


class EvictResult:
    """What ``evict`` freed (or, with ``dry_run``, would free)."""

    def __init__(self, reply: dict) -> None:
        self.objects = [ObjectInfo.from_dict(o) for o in reply["evicted"]]
        self.count: int = reply["count"]
        self.bytes: int = reply["bytes"]
        self.skipped_leased: int = reply["skipped_leased"]
        self.dry_run: bool = reply["dry_run"]

    def __repr__(self) -> str:
        verb = "would evict" if self.dry_run else "evicted"
        return f"<EvictResult {verb} {self.count} objects, {self.bytes} bytes>"


class Client:
    """A connection to the node's kvbroker daemon.

    ``socket_path`` None means ``$KVBROKER_SOCKET`` or the default path. ``map_pools`` maps
    (and pre-faults) every pool at connect, as an engine wants; tools that only look at the
    daemon pass False and never touch the pools. ``busy_poll``: seconds to poll for a reply
    before sleeping, while the host has a CPU to spare (lower latency for a little CPU; 0
    turns it off). ``arena_size``: bytes
    of the write arena this client holds so that a put of up to half of it is one round
    trip (0: every put reserves, then seals).

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
        busy_poll: float = 100e-6,
        reconnect: float = 5.0,
        arena_size: int = 2 << 20,
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
        self._maps: dict[int, PoolMapping] = {}
        self._closed = False
        # Puts of objects up to half this size take one round trip (see _arena.py); 0: off.
        # Small on purpose: measured, a 2 MiB arena beats 8 MiB at 256 KiB-4 MiB puts (its
        # pages are reused while still in cache; big objects gain little from one round trip).
        self._arena = WriteArena(self, arena_size if map_pools else 0)
        self._connect()

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
                for m in self._maps.values():
                    _process_maps.release(m.name)
                self._maps.clear()
                self.pools = hello["pools"]
            if self._map_pools:
                for pool in self.pools:
                    self._mapping(pool["index"])
        except BaseException:
            session.close()
            raise
        if generation:  # replacing a connection: say why, for LeaseExpired messages
            if hello["server_pid"] != self.server_pid or hello.get("epoch") != self.epoch:
                self.restarts += 1
                self._lost = (f"the daemon restarted (pid {self.server_pid} -> "
                              f"{hello['server_pid']}, epoch {self.epoch} -> "
                              f"{hello.get('epoch')})")  # fmt: skip
            else:
                self._lost = "the connection to the daemon was lost"
        self.session_id: int = hello["session"]
        self.server_pid: int = hello["server_pid"]
        self.epoch: int | None = hello.get("epoch")
        self.generation = generation
        self._session = session  # publish: last

    def _call(self, op: str, **args: Any) -> Any:
        session = self._session
        try:
            return session.call(op, **args)
        except BrokerUnavailable:
            if not session.broken or not self._recover(session):
                raise  # a reply saying so (a draining daemon), or reconnecting is off
        if op in _LEASE_OPS:  # the lease went with the old connection
            raise LeaseExpired(self._lost_lease_message(args.get("lease")))
        return self._session.call(op, **args)

    def _send_only(self, op: str, **args: Any) -> None:
        session = self._session
        try:
            session.send_only(op, **args)
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

    def _mapping(self, index: int) -> PoolMapping:
        m = self._maps.get(index)
        if m is None:
            p = self.pools[index]
            m = self._maps[index] = _process_maps.acquire(
                p["name"], lambda: PoolMapping(index, p["name"], p["size"])
            )
        return m

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._session.close()  # the daemon ends every lease of this connection
        for m in self._maps.values():
            _process_maps.release(m.name)
        self._maps.clear()

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
    ) -> WriteLease:
        """A write lease with one writable view per named buffer; raises Exists if published.

        ``consumers``: how many consume-claims must be released before the object is freed.
        ``checksum``: hash the buffers at seal so claimers can verify them (costs one extra
        read of the written bytes; False skips it, and a daemon with require_checksums then
        refuses the seal).
        """
        reply = self._call(
            "reserve", namespace=namespace, key=key, buffers=dict(sizes), meta=meta,
            replace=replace, ttl=ttl, consumers=consumers,
        )  # fmt: skip
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
    ) -> bool:
        """Publish ``buffers`` (numpy arrays, torch CPU tensors or bytes-like) under ``key``.

        Copies each byte once into the pool, then seals. Returns False when the key is
        already published and ``replace`` is False; nothing is copied then, except for an
        object small enough for the write arena (half of ``arena_size``), which is copied
        into this client's arena first and published in one round trip (see _arena.py). ``checksum``: hash each
        chunk right after copying it (still one pass over memory) and record the digests.
        """
        sizes = {name: nbytes_of(b) for name, b in buffers.items()}
        if self._arena.fits(sum(sizes.values())):
            done = self._arena.put(key, buffers, sizes, namespace=namespace, meta=meta,
                                   replace=replace, consumers=consumers, checksum=checksum)
            if done is not None:
                return done
        try:
            lease = self.reserve(key, sizes, namespace=namespace, meta=meta, replace=replace,
                                 ttl=ttl, consumers=consumers, checksum=checksum)  # fmt: skip
        except Exists:
            if replace:
                raise
            return False
        with lease:
            if checksum:
                lease.checksums = {
                    name: _integrity.copy_hashed(lease[name], src, copy_into)
                    if sizes[name] else _EMPTY_DIGEST
                    for name, src in buffers.items()
                }  # fmt: skip
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
    ) -> ReadLease:
        """A read lease on a sealed object.

        ``select``: a regex that buffer names must match in full; ``consume``: free the
        object when this lease is released; ``wait``: seconds to wait for the key to be
        sealed (else NotFound at once; Timeout when the wait runs out). ``verify``: re-hash
        the buffers before returning (one read of them) and raise ChecksumMismatch, with the
        lease released, if any differs from its checksum recorded at seal.
        """
        if wait is not None and self._timeout is not None:
            self._session._stream.transport.settimeout(self._timeout + wait)
        asked_at = time.monotonic()
        try:
            reply = self._call(
                "claim", namespace=namespace, key=key, select=select, consume=consume,
                wait=wait, ttl=ttl,
            )  # fmt: skip
        finally:
            if wait is not None and self._timeout is not None:
                self._session._stream.transport.settimeout(self._timeout)
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
    ) -> dict[str, Any]:
        """Claim, copy every selected buffer out once, release.

        ``out`` maps buffer names to destinations (numpy arrays, torch tensors, writable
        bytes-like) of the right size; buffers not in ``out`` get fresh uint8 arrays.
        ``verify``: hash each chunk as it is copied out (still one pass) and raise
        ChecksumMismatch instead of returning bytes that differ from those sealed (the
        destinations in ``out`` then hold the bad bytes: do not use them).
        """
        np = _np()
        result: dict[str, Any] = {}
        with self.claim(key, namespace=namespace, select=select, consume=consume,
                        wait=wait) as lease:  # fmt: skip
            sums = lease.checksums if verify else None
            bad = []
            for name in lease:
                src = lease[name]
                dst = None if out is None else out.get(name)
                if dst is None:
                    target = result[name] = np.empty(src.nbytes, dtype=np.uint8)
                elif _torch_tensor(dst):
                    torch = sys.modules["torch"]
                    target = dst.view(-1).view(torch.uint8).numpy()
                elif isinstance(dst, np.ndarray):
                    target = dst.reshape(-1).view(np.uint8)
                else:
                    target = np.frombuffer(dst, dtype=np.uint8)
                if sums and name in sums:
                    if _integrity.copy_out_hashed(target, src) != sums[name]:
                        bad.append(name)
                else:
                    np.copyto(target, src)
                if dst is not None:
                    result[name] = dst
            _integrity.check(namespace, key, bad)
        return result

    # -- directory -------------------------------------------------------------------------
    def exists(self, key: str, *, namespace: str = "default") -> bool:
        return self._call("lookup", namespace=namespace, key=key) is not None

    def lookup(self, key: str, *, namespace: str = "default") -> ObjectInfo | None:
        info = self._call("lookup", namespace=namespace, key=key)
        return None if info is None else ObjectInfo.from_dict(info)

    def list(
        self, match: str | None = None, *, namespace: str | None = None, limit: int | None = None
    ) -> list[ObjectInfo]:
        reply = self._call("list", namespace=namespace, match=match, limit=limit)
        return [ObjectInfo.from_dict(o) for o in reply["objects"]]

    def evict(
        self,
        key: str | None = None,
        *,
        match: str | None = None,
        namespace: str | None = None,
        match_buffers: str | None = None,
        older_than: float | None = None,
        all: bool = False,
        dry_run: bool = False,
    ) -> EvictResult:
        """Free sealed objects matching every filter given; leased ones are skipped.

        With ``key`` and no ``namespace``, the key is evicted from every namespace.
        """
        return EvictResult(self._call(
            "evict", key=key, match=match, namespace=namespace, match_buffers=match_buffers,
            older_than=older_than, all=all, dry_run=dry_run,
        ))  # fmt: skip

    def renew(self, *leases: _Lease, ttl: float | None = None) -> None:
        self._call("renew", leases=[ls.id for ls in leases], ttl=ttl)

    # -- statistics ------------------------------------------------------------------------
    def stat(self) -> Statistics:
        return Statistics.from_dict(self._call("stat"))

    def watch(self, interval: float = 1.0) -> Iterator[Statistics]:
        """Snapshots pushed by the daemon every ``interval`` seconds, forever."""
        while True:
            self._call("watch", interval=interval)
            self._session._stream.transport.settimeout(max(30.0, interval * 10))
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

    return f"{os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else 'python'}:{os.getpid()}"
