"""Leases, from the client's side: views over a lease's extents, and how each lease ends.

- A :class:`WriteLease` (``Client.reserve``) lends you writable views of fresh extents. You
  own the writing; the broker owns the memory. ``seal`` publishes, ``abort`` discards.
  Leaving the ``with`` block seals, or aborts when it is left by an exception. After either,
  the views must not be touched: the extents belong to the object (or to the next owner).
  :func:`seal_many` seals several in one round trip (prefix blocks, parents first).
- A :class:`ReadLease` (``Client.claim``) lends you read-only views of a sealed object. They
  are valid until ``release`` (the end of the ``with`` block), TTL expiry or the connection
  closing. Copy out what you need to keep. ``release`` raising
  :class:`~kvbroker.errors.LeaseExpired` means the lease ended early and what you read may
  have been overwritten. A release well inside the lease's TTL is pipelined: it takes effect
  in the daemon before the client's next call is answered, and at the latest before
  ``close`` returns (which is when a consume-claim's freeing is visible to other clients).
- A lease lives and dies with its connection: after a reconnect, using it raises
  LeaseExpired. The ownership contract as a whole: ``docs/design.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import integrity as _integrity
from .._wire.protocol import name_bytes, request_chunks
from ..errors import BadRequest, KVBrokerError, LeaseExpired, ProtocolError

if TYPE_CHECKING:
    from .client import Client

__all__ = ["WriteLease", "ReadLease", "seal_many"]


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
            view = self.client._mapping(pool).view(offset, nbytes, self._writable)
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
        ((_, granted),) = self.client.ops.renew([self.id], ttl)["expires_in"]
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

    def __init__(
        self, client: Client, namespace: str, key: str, reply: dict, checksum: bool = True
    ) -> None:
        super().__init__(client, namespace, key, reply)
        self.checksum = checksum
        # {buffer: checksum in its wire form}, set by whoever filled the views (None: hash
        # them at seal, with the client's checksum_kind, if ``checksum``)
        self.checksums: dict[str, Any] | None = None

    def seal(self) -> None:
        self._check_alive()
        sums = self.checksums
        if sums is None and self.checksum and not self.ended:
            kind = self.client.checksum_kind
            sums = {name: _integrity.digest(self[name], kind) for name in self._extents}
        self._drop_views()
        try:
            self.client.ops.seal(self.id, sums)
        except (BadRequest, ProtocolError):
            # Refused (bad or missing checksums...): the views are gone, so free the pages.
            try:
                self.client.ops.abort(self.id)
            except KVBrokerError:
                pass
            raise

    def abort(self) -> None:
        if not self.ended and self._generation != self.client.generation:
            self._drop_views()  # the reservation went with the old connection
        if not self.ended:
            self._drop_views()
            self.client.ops.abort(self.id)

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
        # {buffer: checksum (wire form, kvbroker._wire.checksum)} recorded at seal, for the
        # buffers of this lease; None if the writer sealed without checksums.
        self.checksums: dict[str, Any] | None = reply.get("checksums")

    def verify(self) -> None:
        """Re-hash the leased buffers; raise ChecksumMismatch naming those that differ from
        the checksums recorded at seal (buffers sealed without one are not checked)."""
        if self.checksums:
            bad = _integrity.mismatched({n: self[n] for n in self._extents}, self.checksums)
            _integrity.check(self.namespace, self.key, bad)

    def release(self, consume: bool = True) -> None:
        """End the lease. Raises LeaseExpired if it had already ended (see the module doc).

        ``consume`` False ends a consume claim without counting it towards freeing the object:
        the reader gave up, unused (one round trip; for failure paths)."""
        if self.ended:
            return
        if not consume:
            self._drop_views()
            self.client.ops.release(self.id, consume=False)
            return
        self._check_alive()
        self._drop_views()
        if time.monotonic() < self._safe_until:
            # A read lease ends early only by TTL or by its connection closing: well inside
            # its TTL the release cannot fail, so its reply is checked by the next call.
            self.client.ops.release_later(self.id)
        else:
            self.client.ops.release(self.id)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.release()
        elif not self.ended:
            try:  # the reader failed: a consume claim does not count (state: who frees what)
                self.release(consume=False)
            except KVBrokerError:
                pass


def seal_many(leases: Sequence[WriteLease]) -> None:
    """Seal write leases of one client, in order (a parent before its children), each with
    the ``checksums`` whoever filled its views set (None: none): one round trip, or one per
    request's worth of checksums (the daemon reads a request of at most ``MAX_REQUEST``
    bytes). The views end first. A refusal (a daemon that requires checksums, a lease that
    expired meanwhile) aborts every lease not sealed yet rather than leaving them held until
    their TTL, then raises."""
    if not leases:
        return
    client = leases[0].client
    sums = []
    for lease in leases:
        lease._drop_views()
        sums.append(lease.checksums)
    costs = [12 + (sum(name_bytes(n) + 16 for n in s) if s else 1) for s in sums]
    for lo, hi in request_chunks(costs):
        chunk = sums[lo:hi]
        try:
            client.ops.seal_many(
                [lease.id for lease in leases[lo:hi]],
                None if all(s is None for s in chunk) else chunk,
            )
        except KVBrokerError:  # refused whole (batches are all or nothing): none of these
            for lease in leases[lo:]:
                try:
                    client.ops.abort(lease.id)
                except KVBrokerError:
                    pass  # already gone (an expired lease, a lost connection)
            raise
