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
``stat`` and are never evicted, so an arena is kept small (``Client(arena_size=...)``, grown
only while big puts come, below; the daemon caps it at 1/16 of the pool it lies in).

Difference from reserve + seal: the bytes are copied before the daemon is asked, so a put of
a key that is already published copies into the client's own arena for nothing (then
answers False as always; nothing is published, the arena is untouched). Objects larger than
half of ``arena_max``, or a put while another thread of the same client uses the arena, take
the reserve + seal path, where an existing key costs no copy.

Growth: a put bigger than half the arena but no bigger than half of ``Client(arena_max=...)``
(64 MiB by default) doubles the arena until it takes the put: the arena held is given back
and a bigger one opened (two round trips, once per doubling), and from then on puts of that
size are one round trip, not two. A large put pays its requests after a copy long enough
for the daemon to fall asleep, so the request saved is one of the dear ones (a 32 MiB put
on an H100 host: a reserve of 260-289 us and a seal of 219-240 us at d92d877, one publish of
206-218 us with growth, ``benchmarks/results/put-get-phases-h100-host.md`` and its history).
What it costs and how it is bounded:
- the daemon lends at most 1/16 of a pool as one arena, all arenas together at most 1/4 of
  the pools, and under a tenant quota at most 1/4 of it. When it lends less than asked, the
  put uses what it lent if it fits (else reserve + seal), the next arenas are asked at
  ``arena_size``, and growth waits :data:`_GROW_AGAIN` seconds (a quota or a budget that is
  full now may not be later); when it lends nothing, the client holds an arena of
  ``arena_size`` again;
- after :data:`_SHRINK_AFTER` arena puts in a row that ``arena_size`` would have taken, the
  client asks for arenas of ``arena_size`` again, and the daemon gives back the rest of the
  bigger one at the next publish (it keeps no rest of more than twice what is asked);
- an arena that grew is held, not evictable, while its client puts: after
  :data:`_IDLE_GROWN` seconds without a put it goes back (a thread per process,
  :class:`_IdleArenas`, gives it back with a one-way ``abort``) and the next put opens one of
  ``arena_size``; a ``reserve`` of this client refused for room (``PoolFull``,
  ``QuotaExceeded``) gives it back at once and tries again;
- a put of a key that already exists copies into the arena for nothing, so after such a
  put bigger than half of ``arena_size``, puts that big reserve first (an existing key then
  costs one request and no copy) for :data:`_GROW_AGAIN` seconds;
- a namespace the arena's pool does not hold (a tenant whose arena is in its own pool,
  putting into a shared namespace) makes the daemon refuse the publish after the copy: puts
  into it reserve first for :data:`_GROW_AGAIN` seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import integrity as _integrity
from .copy import copy_into
from .ops import Ops
from .._wire.objects import buffer_offsets
from .._wire.protocol import MAX_REQUEST, publish_size
from ..errors import BadRequest, Exists, KVBrokerError, LeaseExpired, PoolFull

if TYPE_CHECKING:
    from .client import Client

__all__ = ["WriteArena"]

log = logging.getLogger("kvbroker.client")

_RETRY_AFTER = 0.5  # seconds without arena after the daemon had no room for one
_GROW_AGAIN = 30.0  # seconds before growing again after the daemon lent less than asked
_SHRINK_AFTER = 16  # arena puts in a row that arena_size would take: back to arena_size
_IDLE_GROWN = 0.5  # seconds without a put before an arena that grew goes back
_REFUSED_MAX = 64  # namespaces remembered as refused by the arena's pool
_NEVER = (0.0, -1)
_FEW_BUFFERS = 128  # a publish of this many buffers or fewer is below MAX_REQUEST (512-char names)


def _publish_size(sizes, meta, checksum: bool) -> int:
    """An upper bound on the packed size of a ``publish`` of these buffers."""
    import msgpack

    return publish_size(sizes, checksum) + len(msgpack.packb(meta))


class WriteArena:
    """The arena of one :class:`~kvbroker.Client` (one per connection, opened lazily)."""

    def __init__(self, client: Client, size: int, most: int = 0) -> None:
        self.client = client
        self.base = self.size = size  # asked for by the user; what arenas are asked at now
        self.most = max(size, most) if size > 0 else 0  # what growth may ask for
        self._grow_at = 0.0  # monotonic seconds: no growth before (the daemon lent less)
        self._big_at = 0.0  # no puts over base // 2 through the arena before (a key existed)
        # namespace -> (no arena puts before, the arena's pool then): its publish was refused
        self._refused: dict[str, tuple[float, int]] = {}
        self._small_puts = 0  # arena puts in a row that self.base would have taken
        self._last_put = 0.0  # monotonic seconds (for _IdleArenas)
        self._session: Any = None  # the connection the arena was opened on
        self._lock = threading.Lock()
        self.id: int | None = None
        self.extent: list[int] | None = None  # [pool, offset, nbytes]
        self._generation = -1  # the connection the arena lives on
        self._unavailable = False  # the daemon could not give one: stop asking
        # After "no room for an arena", puts take reserve + seal until then (monotonic
        # seconds), rather than paying a failed ``arena`` round trip each.
        self._retry_at = 0.0

    def fits(self, span: int, namespace: str = "default") -> bool:
        if not (0 < self.size and not self._unavailable):
            return False
        now = time.monotonic()
        if self._held_back(span, namespace, now):
            return False
        extent = self.extent
        if extent is not None and span <= extent[2]:
            return True  # the arena held takes it
        if span > self.size // 2 and not self._may_grow(span, now):
            return False
        return self.id is not None or now >= self._retry_at

    def _held_back(self, span: int, namespace: str, now: float) -> bool:
        """Whether this put reserves first for a while: its namespace's publish was refused,
        or a put this big found its key existing (both cost a copy for nothing)."""
        if self._refused and now < self._refused.get(namespace, _NEVER)[0]:
            return True
        return span > self.base // 2 and now < self._big_at

    def _may_grow(self, span: int, now: float) -> bool:
        return span <= self.most // 2 and now >= self._grow_at

    @property
    def grown(self) -> bool:
        """Whether this arena asks for, or holds, more than ``arena_size``."""
        extent = self.extent
        return self.size > self.base or (extent is not None and extent[2] > self.base)

    def put(
        self,
        key: str,
        buffers: Mapping[str, Any],
        sizes: Mapping[str, int],
        *,
        namespace: str,
        meta: dict | None,
        replace: bool,
        consumers: int,
        checksum: bool,
        retain: dict | None = None,
    ) -> bool | None:
        """Copy ``buffers`` into the arena and publish them as ``key``: True, or False when
        the key exists. None when the arena cannot take this put (busy in another thread,
        too small, none to be had): the caller uses reserve + seal. ``retain``: the session
        that retains the object (``kvbroker.blocks.retention``)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._put(
                key, buffers, sizes, namespace, meta, replace, consumers, checksum, retain
            )
        finally:
            self._lock.release()

    def _put(self, key, buffers, sizes, namespace, meta, replace, consumers, checksum, retain):

        client = self.client
        if len(sizes) > _FEW_BUFFERS and _publish_size(sizes, meta, checksum) > MAX_REQUEST:
            return None  # reserve and seal carry the names and the checksums apart
        offsets, span = buffer_offsets(sizes)
        if self._generation != client.generation:
            self.id = self.extent = None  # it died with an earlier connection
        # decided here, under the lock (fits() only looks)
        now = self._last_put = time.monotonic()
        if self._held_back(span, namespace, now):
            return None
        if self.id is not None and span <= self.extent[2]:
            pass  # the arena held takes it
        elif span <= self.size // 2:
            if self.id is None and not self._open():
                return None
        elif self._may_grow(span, now):
            self.size = min(self.most, max(2 * span, 2 * self.size))
            if not self._regrow(span):
                return None
        else:
            return None
        if self.grown:
            _idle_arenas.watch(self)
        self._small_puts = self._small_puts + 1 if span <= self.base // 2 else 0
        if self._small_puts >= _SHRINK_AFTER and self.size != self.base:
            self.size = self.base  # the next arenas: what the user asked for
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
                self.id,
                key,
                sizes,
                namespace=namespace,
                meta=meta,
                replace=replace,
                consumers=consumers,
                checksums=sums,
                next_arena=self.size,
                retain=retain,
            )
        except Exists:
            if replace:
                raise
            if span > self.base // 2:  # a copy for nothing: reserve such puts first a while
                self._big_at = time.monotonic() + _GROW_AGAIN
            return False
        except PoolFull:
            # The namespace lives in another pool than the arena (a tenant's own pool, or
            # the shared ones), or that pool is gone: reserve + seal instead, and for a while
            # without copying into the arena first.
            if len(self._refused) >= _REFUSED_MAX:
                self._refused.clear()
            self._refused[namespace] = (time.monotonic() + _GROW_AGAIN, pool)
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
        self._session = client._session  # where its id means this arena (give_back_if_idle)
        return True

    def _regrow(self, span: int) -> bool:
        """Give back the arena held (if any) and open one of ``self.size`` bytes for a put of
        ``span``: True when the arena now held takes it. When the daemon lends less than asked
        (its caps, a quota), keep what it lent but ask for arenas of ``self.base`` again, and
        grow again only after :data:`_GROW_AGAIN` seconds; when it lends nothing, hold one of
        ``self.base``."""
        if self.id is not None:
            held, self.id, self.extent = self.id, None, None
            try:
                self.client.ops.abort(held)
            except LeaseExpired:
                pass  # gone with a connection the request just replaced: nothing to give back
        if not self._open() or self.extent[2] < self.size:
            self.size = self.base
            self._grow_at = time.monotonic() + _GROW_AGAIN
            if self.id is None:
                self._open()
        return self.id is not None and span <= self.extent[2]

    def placed(self, namespace: str, pool: int) -> None:
        """A reservation in ``namespace`` landed in ``pool``: if that is the pool of the arena
        whose publish there was refused, the refusal had another cause (a meta too big for
        the arena, say) and arena puts into the namespace go on."""
        refused = self._refused.get(namespace)
        if refused is not None and refused[1] == pool:
            del self._refused[namespace]

    def give_back_grown(self) -> bool:
        """Give back an arena that grew (its client's reserve found no room, perhaps because
        of it): True when it held one. Asks at ``arena_size`` from now on, and grows again
        only after :data:`_GROW_AGAIN` seconds."""
        with self._lock:  # (another thread's put through it: wait for it, then give back)
            if not self.grown:
                return False
            self._grow_at = time.monotonic() + _GROW_AGAIN
            held = self._forget()
            if held is None or self._generation != self.client.generation:
                return False
            try:
                self.client.ops.abort(held)
            except LeaseExpired:
                return False  # gone with the connection already
            return True

    def give_back_if_idle(self, now: float) -> bool:
        """For :class:`_IdleArenas`: give back an arena that grew and saw no put for
        :data:`_IDLE_GROWN` seconds (one-way: no wait, from any thread). True when it is no
        longer grown (nothing more to watch)."""
        if now - self._last_put < _IDLE_GROWN or not self._lock.acquire(blocking=False):
            return False
        try:
            if not self.grown:
                return True
            session = self._session
            held = self._forget()
            # On the connection the arena was opened on, never through the client (which
            # would reconnect from this thread, and whose new connection may give the same
            # id to another lease): an arena that died with its connection needs nothing.
            if held is not None and session is not None and session is self.client._session:
                try:
                    Ops(session.request, session.post).abort_later(held)
                except KVBrokerError:
                    pass  # the connection broke: the arena went with it
            return True
        finally:
            self._lock.release()

    def _forget(self) -> int | None:
        """Drop the arena held (returns its id, for the caller to give back) and ask for
        arenas of ``arena_size`` from now on."""
        held, self.id, self.extent, self._session = self.id, None, None, None
        self.size = self.base
        return held

    def after_fork(self) -> None:
        """In a forked child: the arena's pages are the parent's, its lock maybe held by a
        thread the child does not have. Forget both (nothing to give back: not ours)."""
        self._lock = threading.Lock()
        self.id = self.extent = None
        self._generation = -1
        self._session = None
        self.size, self._small_puts = self.base, 0  # a fresh start: the parent's puts grew it

    def close(self) -> None:
        """Give the arena back now (the connection closing does it too)."""
        with self._lock:
            if self.id is not None and self._generation == self.client.generation:
                self.client.ops.abort(self.id)
            self.id = self.extent = None


class _IdleArenas:
    """One thread per process that gives back arenas that grew and then saw no put for
    :data:`_IDLE_GROWN` seconds: an idle client would otherwise hold up to ``arena_max`` of
    a pool that other clients' puts need (an arena is not evictable). The thread runs only
    while some arena is grown, and is started again in a forked child that grows one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: weakref.WeakSet[WriteArena] = weakref.WeakSet()
        self._running = False

    def watch(self, arena: WriteArena) -> None:
        with self._lock:
            self._arenas.add(arena)
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name="kvbroker-idle-arenas", daemon=True).start()
        except RuntimeError:  # (interpreter shutting down: no threads any more)
            with self._lock:
                self._running = False

    def after_fork_in_child(self) -> None:
        """The parent's thread does not exist here, and its lock may have been held."""
        self._lock = threading.Lock()
        self._running = False

    def _run(self) -> None:
        try:
            while True:
                time.sleep(_IDLE_GROWN / 4)
                with self._lock:
                    arenas = list(self._arenas)
                    if not arenas:  # (under the lock: a watch() from now on starts another)
                        self._running = False
                        return
                now = time.monotonic()
                for arena in arenas:
                    try:
                        done = arena.client._closed or arena.give_back_if_idle(now)
                    except Exception:  # noqa: BLE001 (one arena must not stop the others')
                        log.exception("giving back an idle write arena failed")
                        done = True
                    if done:
                        with self._lock:
                            self._arenas.discard(arena)
        except BaseException:
            with self._lock:
                self._running = False
            raise


_idle_arenas = _IdleArenas()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_idle_arenas.after_fork_in_child)
