"""A client's write arena: a put in one round trip.

A plain put is ``reserve`` (round trip) + copy + ``seal`` (round trip). With an arena the
client already holds fresh pages (opened once with the ``arena`` op), copies into them, and
one ``publish`` names their first pages as the object; the reply says which pages are the
arena from then on (the rest, or a fresh one). See the ``arena`` and ``publish`` rows of the
op table (:mod:`kvbroker._wire.protocol`) and ``docs/design.md``.

Ownership: the daemon owns the arena's pages and lends them to this connection alone, with no
TTL, until they are published, the arena is aborted (``close``), or the connection closes —
a client killed mid-copy leaves nothing behind. (When the daemon, not the client, ended the
connection, or the daemon died, the pages are quarantined for ``restart_quarantine`` seconds
first: this client may still be copying into them.) The pages count as used and write-leased in
``stat`` and are never evicted, so an arena is kept small (``Client(arena_size=...)``, and
the daemon caps it at 1/16 of a pool).

Difference from reserve + seal: the bytes are copied before the daemon is asked, so a put of
a key that is already published copies into the client's own arena for nothing (then
answers False as always; nothing is published, the arena is untouched). Objects larger than
half the arena, or a put while another thread of the same client uses the arena, take the
reserve + seal path, where an existing key costs no copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import integrity as _integrity
from .copy import copy_into
from .._wire.objects import buffer_offsets
from .._wire.protocol import MAX_REQUEST, publish_size
from ..errors import BadRequest, Exists, LeaseExpired, PoolFull

if TYPE_CHECKING:
    from .client import Client

__all__ = ["WriteArena"]

_RETRY_AFTER = 0.5  # seconds without arena after the daemon had no room for one
_FEW_BUFFERS = 128  # a publish of this many buffers or fewer is below MAX_REQUEST (512-char names)


def _publish_size(sizes, meta, checksum: bool) -> int:
    """An upper bound on the packed size of a ``publish`` of these buffers."""
    import msgpack

    return publish_size(sizes, checksum) + len(msgpack.packb(meta))


class WriteArena:
    """The arena of one :class:`~kvbroker.Client` (one per connection, opened lazily)."""

    def __init__(self, client: Client, size: int) -> None:
        self.client = client
        self.size = size
        self._lock = threading.Lock()
        self.id: int | None = None
        self.extent: list[int] | None = None  # [pool, offset, nbytes]
        self._generation = -1  # the connection the arena lives on
        self._unavailable = False  # the daemon could not give one: stop asking
        # After "no room for an arena", puts take reserve + seal until then (monotonic
        # seconds), rather than paying a failed ``arena`` round trip each.
        self._retry_at = 0.0

    def fits(self, span: int) -> bool:
        if not (0 < self.size and span <= self.size // 2 and not self._unavailable):
            return False
        return self.id is not None or time.monotonic() >= self._retry_at

    def put(self, key: str, buffers: Mapping[str, Any], sizes: Mapping[str, int], *,
            namespace: str, meta: dict | None, replace: bool, consumers: int,
            checksum: bool) -> bool | None:  # fmt: skip
        """Copy ``buffers`` into the arena and publish them as ``key``: True, or False when
        the key exists. None when the arena cannot take this put (busy in another thread,
        too small, none to be had): the caller uses reserve + seal."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._put(key, buffers, sizes, namespace, meta, replace, consumers, checksum)
        finally:
            self._lock.release()

    def _put(self, key, buffers, sizes, namespace, meta, replace, consumers, checksum):

        client = self.client
        if len(sizes) > _FEW_BUFFERS and _publish_size(sizes, meta, checksum) > MAX_REQUEST:
            return None  # reserve and seal carry the names and the checksums apart
        offsets, span = buffer_offsets(sizes)
        if self._generation != client.generation:
            self.id = self.extent = None  # it died with an earlier connection
        if self.id is None and not self._open():
            return None
        pool, base, room = self.extent
        if span > room:
            return None
        mapping = client._mapping(pool)
        sums: dict[str, Any] | None = {} if checksum else None
        kind = client.checksum_kind
        for name, src in buffers.items():
            n = sizes[name]
            if not n:
                if sums is not None:
                    sums[name] = _integrity.empty_digest(kind)
                continue
            dst = mapping.view(base + offsets[name], n, True)
            if sums is not None:
                sums[name] = _integrity.copy_hashed(dst, src, copy_into, kind)
            else:
                copy_into(dst, src)
            del dst
        try:
            reply = client.ops.publish(
                self.id, key, sizes, namespace=namespace, meta=meta, replace=replace,
                consumers=consumers, checksums=sums, next_arena=self.size,
            )  # fmt: skip
        except Exists:
            if replace:
                raise
            return False
        except PoolFull:
            # The namespace lives in another pool than the arena (a tenant's own pool, or
            # the shared ones), or that pool is gone: reserve + seal instead.
            return None
        except LeaseExpired:
            # Only when the connection was replaced under us: the copy went with it.
            self.id = self.extent = None
            return None
        self.id, self.extent = reply["lease"], reply["arena"]
        return True

    def _open(self) -> bool:
        client = self.client
        try:
            reply = client.ops.arena(self.size)
        except PoolFull:
            self._retry_at = time.monotonic() + _RETRY_AFTER  # memory may free up later
            return False
        except BadRequest:
            self._unavailable = True  # a daemon without arenas: reserve + seal from now on
            return False
        self.id, self.extent = reply["lease"], reply["arena"]
        self._generation = client.generation
        return True

    def after_fork(self) -> None:
        """In a forked child: the arena's pages are the parent's, its lock maybe held by a
        thread the child does not have. Forget both (nothing to give back: not ours)."""
        self._lock = threading.Lock()
        self.id = self.extent = None
        self._generation = -1

    def close(self) -> None:
        """Give the arena back now (the connection closing does it too)."""
        with self._lock:
            if self.id is not None and self._generation == self.client.generation:
                self.client.ops.abort(self.id)
            self.id = self.extent = None
