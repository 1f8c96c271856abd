"""The disk tier (``[tier.disk]``): objects the pools give up kept on local disk, promoted
back into a pool when asked for, and found again by a daemon started after a reboot.

:class:`DiskTier` owns the tier's state: its entries (one per object on disk, by
``(namespace, key)``), their LRU, the bytes each quota account holds there, the writes and
reads in flight, and its counters (:meth:`DiskTier.statistics`). The storage under it — slot
files, index log, I/O threads — is :class:`~kvbroker._server.disk_store.DiskStore`. The
broker calls it through a few hooks and gives it narrow callables; it never sees the broker.

How an object moves
-------------------
- *Write-back* (:meth:`write_back`): a sealed object in a pool is copied to a slot while it
  stays in the pool, read from its pages (the broker holds it as a reader for the
  write, then puts it back at the old end of its LRU: it is the cheapest to evict now). The
  broker asks for it above ``[tier.disk] writeback_watermark`` (policy ``evicted``, the
  least recently used first) or for every seal (policy ``sealed``, so all of the pools
  survive a reboot). At most ``writeback_inflight`` bytes are being written at once.
- *Demotion* (:meth:`demote`, from the broker's eviction): an object with a copy on disk
  is just dropped from its pool; one without is copied out of its pages (they are reused at
  once) into a buffer that is written in the background. When no slot, quota or in-flight
  budget is left, the object is dropped as before the tier existed (counted).
- *Promotion* (:meth:`promote`, from a claim, a prefix match or ``get`` that finds the key
  only here): fresh pages are reserved in a pool (a write lease of the daemon, charged to the
  asker's quotas), the slot is read, its bytes hashed and compared with the digest
  recorded at the write, and written into them. Only then is the object sealed and the
  request answered; a slot that does not hash to its digest is dropped, never served.
  Concurrent requests for one object share its one read. The disk copy stays (the tiers are
  inclusive): evicting a promoted object again costs no write.
- A key unlinked for any reason other than eviction (replaced, consumed, ``evict``) loses
  its disk copy too (:meth:`forget`).

Quotas: each tier has its own. An account's share of the disk is its ``[quotas]`` share of
the pools, scaled by ``disk size / pool size``: a tenant's cold objects on disk then never
push its hot ones out of the pools (as one quota over both tiers would, DRAM being 10-100x
scarcer), and one tenant cannot fill the disk either. Over its disk share, an account's own
oldest disk objects go first; past that, the demotion is skipped.

Memory: a slot takes at least its object's index entry (names, meta, tokens) scaled by the
same ratio (:func:`~kvbroker._server.disk_entry.slot_units`), so the entries of a full disk
take no more of the daemon's memory than those of full pools; an ordinary KV object's slot
is its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from .._wire.stats import DiskTierStatistics
from .disk_entry import DiskEntry, entry_of_record, object_record, slot_units, written_length
from .disk_promotion import Promotion
from .disk_store import DiskStore, Loaded, PoolPages
from .disk_writeback import Queries, QuotaShares, WriteBackPass
from .state import index_footprint

__all__ = ["POLICIES", "DiskEntry", "DiskTier"]

log = logging.getLogger("kvbroker.disk")

POLICIES = ("evicted", "sealed")


class DiskTier(WriteBackPass, QuotaShares, Queries, Promotion):
    """The disk tier's entries, LRU, quota shares, I/O in flight and counters."""

    def __init__(
        self,
        store: DiskStore,
        pools: list[PoolPages],
        *,
        policy: str = "evicted",
        writeback_watermark: float = 0.8,
        writeback_inflight: int = 256 << 20,
        quota_of: Callable[[Any], int | None] = lambda account: None,
        quota_scale: float = 1.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.store = store
        self.pools = pools  # each pool's pages (read and written, never mapped), by index
        self.policy = policy
        self.writeback_watermark = writeback_watermark
        self.writeback_inflight = writeback_inflight
        self.quota_of = quota_of  # an account's [quotas] limit in the pools (None: none)
        self.quota_scale = quota_scale  # disk size / pool size
        self.entries: dict[tuple[str, str], DiskEntry] = {}
        self.lru: OrderedDict[tuple[str, str], DiskEntry] = OrderedDict()  # written, unread
        self.usage: Counter[Any] = Counter()  # account -> bytes on disk
        self.inflight = 0  # bytes being written
        self._promotions: dict[tuple[str, str], asyncio.Future] = {}
        self._syncing = False
        self._tasks: set[asyncio.Future] = set()
        self.counters: Counter[str] = Counter()
        self.loaded = Loaded()
        WriteBackPass.__init__(self)
        self._pooled: set[DiskEntry] = set()  # entries with a copy in a pool too
        self.hidden = False  # a request run again after its promotion: has() is False
        self._unsynced: list[DiskEntry] = []  # written; their p record not synced yet
        self._in_sync: list[DiskEntry] = []  # ... being synced
        # Told of an entry announced on the KV event stream as it leaves the disk (the
        # daemon's EventFeed, kvbroker._server.fleet_events; None without one).
        self.on_dropped: Callable[[DiskEntry], None] | None = None

    # ------------------------------------------------------------------ start
    def open(self) -> Loaded:
        """Read the index back: every entry it vouches for, written, not in a pool; then
        start a fresh index file holding just those."""
        loaded = self.store.index.load()
        if loaded.reset:
            log.warning("[tier.disk] starting empty: %s", loaded.reset)
        for slot, rec in loaded.entries.items():
            e = entry_of_record(slot, rec, self.store.unit, self.quota_scale)
            if e is None or e.ident in self.entries:
                loaded.dropped += 1
                continue
            self.entries[e.ident] = e
            self.lru[e.ident] = e
            self._charge(e)
        found = sorted(self.entries.values(), key=lambda e: e.record.get("created_at") or 0)
        for at, e in enumerate(found):  # before every object sealed from now on, for list
            e.seq = at - len(found)
        self.counters["recovered"] = len(self.entries)
        self.store.adopt([(e.file, e.start, e.units) for e in self.entries.values()])
        self.store.index.rewrite([e.to_record() for e in self.entries.values()])
        self.store.index.records = len(self.entries) + 1
        self.loaded = loaded
        if self.entries or loaded.damaged or loaded.dropped:
            log.info(
                "[tier.disk] %d object(s) on disk; dropped %d damaged and %d unvouched "
                "index record(s)",
                len(self.entries),
                loaded.damaged,
                loaded.dropped,
            )
        return loaded

    def adopt_pool_objects(self, objects: Iterable[Any]) -> None:
        """After a warm restart: the pools' objects that have their copy here are in a pool
        too; a key whose pool object is another one than the disk copy's loses the copy."""
        for obj in objects:
            e = self.entries.get((obj.namespace, obj.key))
            if e is None:
                continue
            if e.serial == obj.serial:
                self._pool_copy(e, obj)
            else:
                self.forget(e.ident)

    # ------------------------------------------------------------------ queries
    def has(self, ident: tuple[str, str]) -> bool:
        e = self.entries.get(ident)
        return e is not None and not self.hidden and self.live(e)

    def live(self, e: DiskEntry) -> bool:
        """Whether ``e`` still stands for its key: not forgotten, and the pool object it
        copies, if any, still linked (one unlinked other than by eviction, so consumed,
        replaced or evicted on purpose, takes its disk copy with it: dropped here)."""
        if e.obj is not None and not e.obj.linked:
            self._drop(e)
        return not e.gone

    def sweep(self) -> None:
        """Drop the disk copies of pool objects unlinked since, note the consume-claims
        released since, and try again the index records a failed sync left (the daemon's
        tick, once a second)."""
        for e in list(self._pooled):
            if not e.obj.linked:
                self._drop(e)
            else:
                self._consumers(e, e.obj.consumers)
        self._sync_index()  # records a failed sync (a full disk) left pending: again

    def _consumers(self, e: DiskEntry, consumers: int) -> None:
        """Consume-claims released since ``e`` was written: in its record and the index (a
        ``c`` record), or a restart after a reboot would let the object be consumed again
        as often as when it was written."""
        if consumers == (e.record.get("consumers") or 1):
            return
        e.record["consumers"] = consumers
        if e.written:
            self.store.index.append({"t": "c", "f": e.file, "s": e.start, "c": consumers})

    def _pool_copy(self, e: DiskEntry, obj: Any) -> None:
        """``e`` is a copy of pool object ``obj`` from now on (None: on disk only)."""
        e.obj = obj
        if obj is None:
            self._pooled.discard(e)
        else:
            self._pooled.add(e)

    def copy_of(self, obj: Any) -> DiskEntry | None:
        """The disk copy of exactly this pool object, if there is one."""
        e = self.entries.get((obj.namespace, obj.key))
        return e if e is not None and not e.gone and e.obj is obj else None

    # ------------------------------------------------------------------ writing
    def _reserve(self, obj: Any, length: int) -> DiskEntry | None:
        """A slot and an entry for ``obj`` (its disk share made room for), or None."""
        ident = (obj.namespace, obj.key)
        old = self.entries.get(ident)
        if old is not None:
            self.forget(ident)
        footprint = index_footprint(obj.buffers, obj.meta, obj.tokens)
        units = slot_units(length, footprint, self.quota_scale, self.store.unit)
        nbytes = units * self.store.unit
        accounts = [obj.namespace, *obj.tenants]
        for account in accounts:
            if not self._make_room(account, nbytes):
                self.counters["skipped_quota"] += 1
                return None
        slot = self.store.allocate(nbytes)
        while slot is None and self.lru:
            self._evict_oldest()
            slot = self.store.allocate(nbytes)
        if slot is None:
            self.counters["skipped_full"] += 1
            return None
        e = DiskEntry(
            ident, slot, length, object_record(obj), obj.serial, nbytes, tuple(obj.tenants)
        )
        self.entries[ident] = e
        self._charge(e)
        self._pool_copy(e, obj)
        return e

    def write_back(self, obj: Any, done: Callable[[], None]) -> bool:
        """Copy pool object ``obj`` to disk while it stays in its pool; the caller holds it
        (a reader) until ``done`` is called, on the loop, when the write ended either way.
        False (and ``done`` never called) when nothing is written."""
        if self.inflight >= self.writeback_inflight or self.copy_of(obj) is not None:
            return False
        length = written_length(obj, self.store.unit)
        e = self._reserve(obj, length)
        if e is None:
            return False
        pages, offset = self.pools[obj.pool.index], obj.start * obj.pool.page_size
        # (read in the I/O thread: the caller holds the object while it is written)
        self._start_write(e, lambda view: pages.read(offset, view), done)
        self.counters["written_back"] += 1
        return True

    def demote(self, obj: Any) -> bool:
        """``obj`` is being evicted from its pool: True when it stays reachable here (its copy
        was written, or is being written from a copy of its pages made now)."""
        e = self.copy_of(obj)
        if e is not None:
            e.seq = obj.seq
            self._pool_copy(e, None)
            self._consumers(e, obj.consumers)  # consume-claims released since the write
            self._sync_index()
            self.counters["demoted"] += 1
            return True
        length = written_length(obj, self.store.unit)
        if self.inflight + length > self.writeback_inflight:
            self.counters["skipped_busy"] += 1
            return False
        buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
        try:  # copied now: its pages are reused once it is evicted
            with memoryview(buf) as view:
                self.pools[obj.pool.index].read(obj.start * obj.pool.page_size, view)
        except OSError as exc:
            buf.close()
            self.counters["pool_errors"] += 1
            log.error("[tier.disk] %s/%s not demoted: %s", obj.namespace, obj.key, exc)
            return False
        e = self._reserve(obj, length)
        if e is None:
            buf.close()
            return False
        e.seq = obj.seq
        self._pool_copy(e, None)
        self._start_write(e, None, buf.close, buf)
        self.counters["demoted"] += 1
        return True

    def _start_write(
        self,
        e: DiskEntry,
        fill: Callable[[memoryview], None] | None,
        done: Callable[[], None],
        filled: mmap.mmap | None = None,
    ) -> None:
        """Write ``e``'s bytes to its slot: those of ``filled``, or those ``fill`` puts in a
        buffer of its length in the I/O thread; ``done`` is called on the loop when the
        write ended."""
        self.inflight += e.length
        loop = asyncio.get_running_loop()

        def write() -> int:
            with memoryview(filled) if filled is not None else self.store.scratch(e.length) as view:
                if fill is not None:
                    fill(view)
                digest = xxhash.xxh3_64_intdigest(view)
                self.store.write(e.file, e.start, [view])
            return digest

        fut = loop.run_in_executor(self.store.pool, write)
        self._tasks.add(fut)
        e.writing = fut

        def finished(f: asyncio.Future) -> None:
            self._tasks.discard(f)
            self.inflight -= e.length
            done()
            exc = f.exception() if not f.cancelled() else RuntimeError("cancelled")
            if exc is not None:
                self.counters["write_errors"] += 1
                log.warning("[tier.disk] write of %s/%s failed: %s", *e.ident, exc)
                self._drop(e)
                self._release_slot(e)  # never named in the index: free at once
                return
            if e.gone:  # forgotten while being written: never named in the index either
                self._release_slot(e)
                return
            e.digest = f.result()
            e.written = True
            self.counters["writes"] += 1
            self.counters["written_bytes"] += e.length
            self.lru[e.ident] = e
            self.store.index.append(e.to_record())
            self._unsynced.append(e)
            self._sync_index()
            self.kick()  # room in flight again

        fut.add_done_callback(finished)

    # ------------------------------------------------------------------ forgetting
    def forget(self, ident: tuple[str, str]) -> bool:
        """The key's object is gone (replaced, consumed, evicted on purpose): its disk copy
        goes too. True when there was one."""
        e = self.entries.get(ident)
        if e is None or e.gone:
            return False
        self._drop(e)
        return True

    def _drop(self, e: DiskEntry) -> None:
        if e.gone:
            return
        e.gone = True
        if e.announced:
            e.announced = False
            if self.on_dropped is not None:
                self.on_dropped(e)
        self._pooled.discard(e)
        if self.entries.get(e.ident) is e:
            del self.entries[e.ident]
        if self.lru.get(e.ident) is e:
            del self.lru[e.ident]
        self._uncharge(e)
        if e.written and e.reading == 0:
            self._release_slot(e)  # else: the write's or the read's end releases it

    def _release_slot(self, e: DiskEntry) -> None:
        """Free its slot (reusable at once: an index record naming a slot written since is
        caught by its digest at promotion) and, if the index named it, say so there."""
        if e.units == 0:
            return
        if e.written:
            self.store.index.append({"t": "x", "f": e.file, "s": e.start})
            self._sync_index()
        self.store.free(e.file, e.start, e.units)
        e.units = 0

    def _evict_oldest(self, among: Callable[[DiskEntry], bool] | None = None) -> bool:
        for e in self.lru.values():
            if among is None or among(e):
                self.counters["evicted"] += 1
                self._drop(e)
                return True
        return False

    def evict(self, chosen: Callable[[DiskEntry], bool]) -> list[DiskEntry]:
        """Drop the disk copies ``chosen`` picks (``evict --tier disk``); returns them."""
        gone = [e for e in list(self.entries.values()) if chosen(e)]
        for e in gone:
            self._drop(e)
        self.counters["evicted"] += len(gone)
        return gone

    # ------------------------------------------------------------------ the index
    def _sync_index(self) -> None:
        """Write and fsync the records appended, in an I/O thread, one sync at a time
        (compacted when it grew to twice the live entries). Records a sync could not write
        (a full disk) are tried again first by the next one (:meth:`sweep`, a later write)."""
        if self._syncing or not self.store.index.pending:
            return
        self._syncing = True
        index = self.store.index
        compact = index.records > 2 * len(self.entries) + 1024
        live = [e.to_record() for e in self.entries.values() if e.written] if compact else None
        recs = index.take()  # (a compaction's live stands for them)
        batch, self._unsynced = self._unsynced, []
        self._in_sync = batch

        def sync() -> None:
            if live is not None:
                index.rewrite(live)
            else:
                index.write_out(recs)

        fut = asyncio.get_running_loop().run_in_executor(self.store.pool, sync)
        self._tasks.add(fut)

        def synced(f: asyncio.Future) -> None:
            self._tasks.discard(f)
            self._syncing = False
            self._in_sync = []
            if f.cancelled() or f.exception() is not None:
                self.counters["index_errors"] += 1
                log.error(
                    "[tier.disk] index write failed (tried again): %s",
                    "cancelled" if f.cancelled() else f.exception(),
                )
                index.put_back(recs)
                self._unsynced[:0] = batch
                return
            if live is not None:  # (what was appended meanwhile is still pending)
                index.records = len(live) + 1 + len(index.pending)
            self._sync_index()

        fut.add_done_callback(synced)

    async def drain(self) -> None:
        """Wait for every write and index sync in flight (a stop)."""
        while self._tasks or self._promotions:
            await asyncio.gather(*self._tasks, *self._promotions.values(), return_exceptions=True)
            await asyncio.sleep(0)

    def close(self) -> None:
        self.store.close()
        for pages in self.pools:
            pages.close()

    # ------------------------------------------------------------------ statistics
    def statistics(self) -> DiskTierStatistics:
        c = self.counters
        store = self.store
        return DiskTierStatistics(
            directories=tuple(store.directories),
            capacity=store.capacity,
            used=store.used,
            objects=sum(1 for e in self.entries.values() if e.written),
            index_pending=len(self._unsynced) + len(self._in_sync),
            only_on_disk=sum(1 for e in self.entries.values() if e.obj is None),
            bytes=sum(e.nbytes for e in self.entries.values()),
            policy=self.policy,
            o_direct=store.direct,
            o_direct_problem=store.direct_problem,
            writing_bytes=self.inflight,
            promoting=len(self._promotions),
            writes=c["writes"],
            written_bytes=c["written_bytes"],
            written_back=c["written_back"],
            demoted=c["demoted"],
            promoted=c["promoted"],
            promoted_bytes=c["promoted_bytes"],
            promote_seconds=c["promote_us"] / 1e6,
            evicted=c["evicted"],
            dropped_damaged=c["dropped_damaged"],
            skipped=c["skipped_full"] + c["skipped_quota"] + c["skipped_busy"],
            errors=c["write_errors"] + c["read_errors"] + c["index_errors"] + c["pool_errors"],
            recovered=c["recovered"],
            recovered_dropped=self.loaded.damaged + self.loaded.dropped,
        )


def on_disk_only(tier: DiskTier | None, ident: tuple[str, str]) -> bool:
    """Whether ``ident`` is on disk (``tier``: the daemon's, or None) and claimable from
    there: what a request that finds no pool object of it asks before it gives up."""
    return tier is not None and tier.has(ident)
