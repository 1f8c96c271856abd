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
  stays in the pool, straight from the pool's pages (the broker holds it as a reader for the
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
  asker's quotas), the slot is read straight into them, and the bytes are hashed and
  compared with the digest recorded at the write. Only then is the object sealed and the
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
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from .._wire.stats import DiskTierStatistics
from ..errors import NotFound
from .disk_store import DiskStore, Loaded

__all__ = ["POLICIES", "DiskEntry", "DiskTier"]

log = logging.getLogger("kvbroker.disk")

POLICIES = ("evicted", "sealed")


class DiskEntry:
    """One object on disk: its slot, the digest of what was written, and what a pool needs
    to seal it again (its record)."""

    __slots__ = (
        "charged",
        "digest",
        "file",
        "gone",
        "ident",
        "in_pool",
        "last_access",
        "length",
        "reading",
        "record",
        "serial",
        "start",
        "tenants",
        "units",
        "written",
    )

    def __init__(self, ident: tuple[str, str], slot: tuple[int, int, int], length: int,
                 record: dict[str, Any], serial: int, charged: int,
                 tenants: tuple[tuple[str, int], ...]) -> None:  # fmt: skip
        self.ident = ident
        self.file, self.start, self.units = slot
        self.length = length  # bytes written from the extent's first byte (page-aligned)
        self.digest: int | None = None  # xxh3_64 of those bytes, once written
        self.record = record  # buffers (relative), meta, checksums, parent, tokens, ...
        self.serial = serial  # of the pool object it copies (a warm restart matches them)
        self.written = False  # its bytes are in the slot, synced: it may be promoted
        self.reading = 0  # promotions reading it: its slot is not freed under them
        self.gone = False  # forgotten while a write or read was in flight
        self.charged = charged
        self.tenants = tenants
        self.in_pool = True  # a copy of it is in a pool too
        self.last_access = time.time()

    @property
    def nbytes(self) -> int:
        return int(self.record["nbytes"])

    def to_record(self) -> dict[str, Any]:
        """Its ``p`` record in the index."""
        return {"t": "p", "f": self.file, "s": self.start, "n": self.units, "l": self.length,
                "d": self.digest, "ns": self.ident[0], "k": self.ident[1], "sr": self.serial,
                "tn": [list(t) for t in self.tenants], "o": self.record}  # fmt: skip


def object_record(obj: Any) -> dict[str, Any]:
    """What promotion needs of a pool object to seal it again (buffers relative to its
    extent)."""
    base = obj.start * obj.pool.page_size
    return {"nbytes": obj.nbytes, "meta": obj.meta, "checksums": obj.checksums,
            "parent_key": obj.parent_key, "tokens": obj.tokens, "consumers": obj.consumers,
            "created_at": obj.created_at,
            "buffers": {name: [off - base, n] for name, (off, n) in obj.buffers.items()}}


class DiskTier:
    """The disk tier's entries, LRU, quota shares, I/O in flight and counters."""

    def __init__(self, store: DiskStore, pool_views: list[memoryview], *, policy: str = "evicted",
                 writeback_watermark: float = 0.8, writeback_inflight: int = 256 << 20,
                 quota_of: Callable[[Any], int | None] = lambda account: None,
                 quota_scale: float = 1.0) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        self.store = store
        self.views = pool_views  # a writable view of each pool's segment, by pool index
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

    # ------------------------------------------------------------------ start
    def open(self) -> Loaded:
        """Read the index back: every entry it vouches for, written, not in a pool; then
        start a fresh index file holding just those."""
        loaded = self.store.index.load()
        if loaded.reset:
            log.warning("[tier.disk] starting empty: %s", loaded.reset)
        for (f, s), rec in loaded.entries.items():
            try:
                ident = (str(rec["ns"]), str(rec["k"]))
                o = rec["o"]
                length, digest = int(rec["l"]), rec["d"]
                tenants = tuple((str(k), int(i)) for k, i in rec.get("tn") or ())
                if (digest.__class__ is not int or not isinstance(o, dict) or length <= 0
                        or length > rec["n"] * self.store.unit or ident in self.entries
                        or not isinstance(o.get("buffers"), dict)):  # fmt: skip
                    raise ValueError
                int(o["nbytes"])
            except (KeyError, TypeError, ValueError):
                loaded.dropped += 1
                continue
            e = DiskEntry(ident, (f, s, rec["n"]), length, o, int(rec.get("sr") or 0),
                          rec["n"] * self.store.unit, tenants)
            e.digest, e.written, e.in_pool = digest, True, False
            self.entries[ident] = e
            self.lru[ident] = e
            self._charge(e)
        self.store.adopt([(e.file, e.start, e.units) for e in self.entries.values()])
        self.store.index.rewrite([e.to_record() for e in self.entries.values()])
        self.loaded = loaded
        if self.entries or loaded.damaged or loaded.dropped:
            log.info("[tier.disk] %d object(s) on disk; dropped %d damaged and %d unvouched "
                     "index record(s)", len(self.entries), loaded.damaged, loaded.dropped)
        return loaded

    def adopt_pool_objects(self, objects: Iterable[Any]) -> None:
        """After a warm restart: the pools' objects that have their copy here are in a pool
        too; a key whose pool object is another one than the disk copy's loses the copy."""
        for obj in objects:
            e = self.entries.get((obj.namespace, obj.key))
            if e is None:
                continue
            if e.serial == obj.serial:
                e.in_pool = True
            else:
                self.forget(e.ident)

    # ------------------------------------------------------------------ queries
    def has(self, ident: tuple[str, str]) -> bool:
        e = self.entries.get(ident)
        return e is not None and not e.gone

    def copy_of(self, obj: Any) -> DiskEntry | None:
        """The disk copy of exactly this pool object, if there is one."""
        e = self.entries.get((obj.namespace, obj.key))
        return e if e is not None and not e.gone and e.serial == obj.serial else None

    def run(self, namespace: str, keys: Iterable[str], in_pool: Callable[[tuple], bool]) -> int:
        """How many of ``keys``, from the first, are in a pool or here."""
        n = 0
        for key in keys:
            ident = (namespace, key)
            if not (in_pool(ident) or self.has(ident)):
                break
            n += 1
        return n

    def wants_write_back(self, used_fraction: float) -> bool:
        return self.policy == "sealed" or used_fraction > self.writeback_watermark

    # ------------------------------------------------------------------ writing
    def _reserve(self, obj: Any, length: int) -> DiskEntry | None:
        """A slot and an entry for ``obj`` (its disk share made room for), or None."""
        ident = (obj.namespace, obj.key)
        old = self.entries.get(ident)
        if old is not None:
            self.forget(ident)
        units = -(-length // self.store.unit)
        nbytes = units * self.store.unit
        accounts = [obj.namespace, *obj.tenants]
        for account in accounts:
            if not self._make_room(account, nbytes):
                self.counters["skipped_quota"] += 1
                return None
        slot = self.store.allocate(length)
        while slot is None and self.lru:
            self._evict_oldest()
            slot = self.store.allocate(length)
        if slot is None:
            self.counters["skipped_full"] += 1
            return None
        e = DiskEntry(ident, slot, length, object_record(obj), obj.serial, nbytes,
                      tuple(obj.tenants))
        self.entries[ident] = e
        self._charge(e)
        return e

    def write_back(self, obj: Any, done: Callable[[], None]) -> bool:
        """Copy pool object ``obj`` to disk while it stays in its pool; the caller holds it
        (a reader) until ``done`` is called, on the loop, when the write ended either way.
        False (and ``done`` never called) when nothing is written."""
        if self.inflight >= self.writeback_inflight or self.copy_of(obj) is not None:
            return False
        length = _written_length(obj, self.store.unit)
        e = self._reserve(obj, length)
        if e is None:
            return False
        view = self.views[obj.pool.index][obj.start * obj.pool.page_size:][:length]
        self._start_write(e, view, done)
        self.counters["written_back"] += 1
        return True

    def demote(self, obj: Any) -> bool:
        """``obj`` is being evicted from its pool: True when it stays reachable here (its copy
        was written, or is being written from a copy of its pages made now)."""
        e = self.copy_of(obj)
        if e is not None:
            e.in_pool = False
            e.record["consumers"] = obj.consumers  # consume-claims released since the write
            self.counters["demoted"] += 1
            return True
        length = _written_length(obj, self.store.unit)
        if self.inflight + length > self.writeback_inflight:
            self.counters["skipped_busy"] += 1
            return False
        e = self._reserve(obj, length)
        if e is None:
            return False
        buf = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
        src = self.views[obj.pool.index]
        start = obj.start * obj.pool.page_size
        buf[:] = src[start:start + length]
        e.in_pool = False
        self._start_write(e, memoryview(buf), buf.close)
        self.counters["demoted"] += 1
        return True

    def _start_write(self, e: DiskEntry, view: memoryview, done: Callable[[], None]) -> None:
        self.inflight += e.length
        loop = asyncio.get_running_loop()

        def write() -> int:
            digest = xxhash.xxh3_64_intdigest(view)
            self.store.write(e.file, e.start, [view])
            return digest

        fut = loop.run_in_executor(self.store.pool, write)
        self._tasks.add(fut)

        def finished(f: asyncio.Future) -> None:
            self._tasks.discard(f)
            self.inflight -= e.length
            view.release()
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
            self._sync_index()

        fut.add_done_callback(finished)

    # ------------------------------------------------------------------ promotion
    async def promote(self, idents: list[tuple[str, str]], reserve: Callable[[DiskEntry], Any],
                      seal: Callable[[list[Any]], None],
                      discard: Callable[[Any], None]) -> int:  # fmt: skip
        """Bring ``idents`` (a chain's blocks in order, or one key) from disk into the pools:
        ``reserve(entry)`` gives a write lease on fresh pages laid out as the entry's
        object, ``seal(leases)`` seals them (parents first), ``discard(lease)`` gives back
        one that was not sealed. Requests for a key already being promoted wait for that
        read. Returns how many of ``idents`` are in a pool now; raises NotFound only when
        the first is neither here nor promoted."""
        mine: list[DiskEntry] = []
        waits: list[asyncio.Future] = []
        for ident in idents:
            fut = self._promotions.get(ident)
            if fut is not None:
                waits.append(fut)
                continue
            e = self.entries.get(ident)
            if e is None or e.gone:
                break
            if not e.written:  # being written: read it once it is
                break
            mine.append(e)
        if mine:
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._read_and_seal(mine, reserve, seal, discard))
            for e in mine:
                self._promotions[e.ident] = task
            task.add_done_callback(lambda _t: [self._promotions.pop(e.ident, None)
                                               for e in mine])  # fmt: skip
            waits.append(task)
        promoted = 0
        errors: list[BaseException] = []
        for fut in waits:
            try:
                promoted += await asyncio.shield(fut)
            except Exception as exc:  # noqa: BLE001 - what each read failed with, said below
                errors.append(exc)
        if promoted == 0 and errors:
            raise errors[0]
        if promoted == 0:
            what = "was dropped from disk (unreadable or damaged)" if waits else \
                "is not on disk either"
            raise NotFound(f"{idents[0][0]}/{idents[0][1]} {what}")
        return promoted

    async def _read_and_seal(self, entries: list[DiskEntry], reserve, seal, discard) -> int:
        loop = asyncio.get_running_loop()
        leases: list[Any] = []
        for e in entries:  # all reserved before any read (a reservation may evict)
            if e.gone:
                break
            try:
                lease = reserve(e)
            except Exception:
                if not leases:
                    raise
                break  # a shorter chain: what fits
            leases.append(lease)
            e.reading += 1
            if self.lru.get(e.ident) is e:
                del self.lru[e.ident]  # not evicted from disk under its read
        entries = entries[:len(leases)]
        t0 = time.perf_counter()
        reads = [loop.run_in_executor(self.store.pool, self._read_one, e, lease)
                 for e, lease in zip(entries, leases)]  # fmt: skip
        results = await asyncio.gather(*reads, return_exceptions=True)
        good: list[Any] = []
        failed = False  # a chain is served up to its first block that cannot be
        for e, lease, ok in zip(entries, leases, results):
            e.reading -= 1
            if not failed and ok is True and not e.gone:
                good.append(lease)
                e.serial = lease.obj.serial  # the pool object it is a copy of, once sealed
                e.in_pool = True
                e.last_access = time.time()
                self.lru[e.ident] = e
                continue
            failed = True
            discard(lease)
            if isinstance(ok, BaseException):
                self.counters["read_errors"] += 1
                log.warning("[tier.disk] read of %s/%s failed: %s", *e.ident, ok)
                self.forget(e.ident)
            elif ok is False:
                self.counters["dropped_damaged"] += 1
                log.warning("[tier.disk] %s/%s: its slot does not hash to the digest "
                            "written; dropped, never served", *e.ident)
                self.forget(e.ident)
            if e.gone:
                if e.units and e.reading == 0:
                    self._release_slot(e)  # forgotten during the read
            else:
                self.lru[e.ident] = e
        if good:
            seal(good)
            self.counters["promoted"] += len(good)
            self.counters["promoted_bytes"] += sum(ls.obj.nbytes for ls in good)
            self.counters["promote_us"] += int((time.perf_counter() - t0) * 1e6)
        return len(good)

    def _read_one(self, e: DiskEntry, lease: Any) -> bool:
        """In an I/O thread: read the slot into the lease's pages; whether they hash to the
        digest written."""
        obj = lease.obj
        view = self.views[obj.pool.index][obj.start * obj.pool.page_size:][:e.length]
        try:
            self.store.read(e.file, e.start, view)
            return xxhash.xxh3_64_intdigest(view) == e.digest
        finally:
            view.release()

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

    # ------------------------------------------------------------------ quotas
    def _charge(self, e: DiskEntry) -> None:
        for account in (e.ident[0], *e.tenants):
            self.usage[account] += e.charged

    def _uncharge(self, e: DiskEntry) -> None:
        for account in (e.ident[0], *e.tenants):
            self.usage[account] -= e.charged
            if self.usage[account] <= 0:
                del self.usage[account]

    def limit(self, account: Any) -> int | None:
        quota = self.quota_of(account)
        return None if quota is None else int(quota * self.quota_scale)

    def _make_room(self, account: Any, nbytes: int) -> bool:
        limit = self.limit(account)
        if limit is None:
            return True
        if nbytes > limit:
            return False

        def owned(e: DiskEntry) -> bool:
            return e.ident[0] == account or account in e.tenants

        while self.usage.get(account, 0) + nbytes > limit:
            if not self._evict_oldest(owned):
                return False
        return True

    # ------------------------------------------------------------------ the index
    def _sync_index(self) -> None:
        """Write and fsync the records appended, in an I/O thread, one sync at a time
        (compacted when it grew to twice the live entries)."""
        if self._syncing or not self.store.index.pending:
            return
        self._syncing = True
        index = self.store.index
        compact = index.records > 2 * len(self.entries) + 1024
        live = [e.to_record() for e in self.entries.values() if e.written] if compact else None
        data = index.take()

        def sync() -> None:
            if live is not None:
                index.rewrite(live)
            else:
                index.write_out(data)

        fut = asyncio.get_running_loop().run_in_executor(self.store.pool, sync)
        self._tasks.add(fut)

        def synced(f: asyncio.Future) -> None:
            self._tasks.discard(f)
            self._syncing = False
            if f.cancelled() or f.exception() is not None:
                self.counters["index_errors"] += 1
                log.error("[tier.disk] index write failed: %s", f.exception())
                return
            self._sync_index()

        fut.add_done_callback(synced)

    async def drain(self) -> None:
        """Wait for every write and index sync in flight (a stop)."""
        while self._tasks or self._promotions:
            await asyncio.gather(*self._tasks, *self._promotions.values(),
                                 return_exceptions=True)  # fmt: skip
            await asyncio.sleep(0)

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ statistics
    def statistics(self) -> DiskTierStatistics:
        c = self.counters
        store = self.store
        return DiskTierStatistics(
            directories=tuple(store.directories), capacity=store.capacity, used=store.used,
            objects=len(self.entries),
            only_on_disk=sum(1 for e in self.entries.values() if not e.in_pool),
            bytes=sum(e.nbytes for e in self.entries.values()),
            policy=self.policy, o_direct=store.direct, o_direct_problem=store.direct_problem,
            writing_bytes=self.inflight, promoting=len(self._promotions),
            writes=c["writes"], written_bytes=c["written_bytes"],
            written_back=c["written_back"], demoted=c["demoted"], promoted=c["promoted"],
            promoted_bytes=c["promoted_bytes"], promote_seconds=c["promote_us"] / 1e6,
            evicted=c["evicted"], dropped_damaged=c["dropped_damaged"],
            skipped=c["skipped_full"] + c["skipped_quota"] + c["skipped_busy"],
            errors=c["write_errors"] + c["read_errors"] + c["index_errors"],
            recovered=len(self.loaded.entries), recovered_dropped=self.loaded.damaged
            + self.loaded.dropped,
        )  # fmt: skip


def _written_length(obj: Any, unit: int) -> int:
    """The bytes of ``obj``'s extent that hold its buffers, rounded up to ``unit`` (never
    past the extent: pages are a multiple of the unit)."""
    base = obj.start * obj.pool.page_size
    end = max((off - base + n for off, n in obj.buffers.values()), default=0)
    return max(unit, -(-end // unit) * unit)
