"""Promotion from the disk tier back into a pool: a chain of blocks read from their slots,
checked against the digest written, sealed as pool objects (a part of :class:`DiskTier`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import xxhash

from ..errors import KVBrokerError, NotFound
from .disk_entry import DiskEntry
from .disk_store import PoolUnusable
from .state import Deferred


log = logging.getLogger("kvbroker.disk")

PROMOTE_TIMEOUT = 120.0  # a request waiting for its promotion: reads of a few slots


class Promotion:
    """Reading disk copies back into the pools (a part of :class:`DiskTier`)."""

    # ------------------------------------------------------------------ promotion
    async def promote(
        self,
        idents: list[tuple[str, str]],
        reserve: Callable[[DiskEntry], Any],
        seal: Callable[[list[Any]], None],
        discard: Callable[[Any], None],
    ) -> int:
        """Bring ``idents`` (a chain's blocks in order, or one key) from disk into the pools:
        ``reserve(entry)`` gives a write lease on fresh pages laid out as the entry's
        object, ``seal(leases)`` seals them (parents first), ``discard(lease)`` gives back
        one that was not sealed. Requests for a key already being promoted wait for that
        read. Returns how many of ``idents`` are in a pool now; raises NotFound only when
        the first is neither here nor promoted."""
        writes = [
            e.writing
            for e in map(self.entries.get, idents)
            if e is not None and not e.written and e.writing is not None
        ]
        if writes:  # evicted a moment ago: read once written
            await asyncio.gather(*map(asyncio.shield, writes), return_exceptions=True)
        mine: list[DiskEntry] = []
        waits: list[asyncio.Future] = []
        for ident in idents:
            fut = self._promotions.get(ident)
            if fut is not None:
                waits.append(fut)
                continue
            e = self.entries.get(ident)
            if e is None or not self.live(e):
                break
            if not e.written:  # being written: read it once it is
                break
            mine.append(e)
        if mine:
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._read_and_seal(mine, reserve, seal, discard))
            for e in mine:
                self._promotions[e.ident] = task
            task.add_done_callback(lambda _t: [self._promotions.pop(e.ident, None) for e in mine])
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
            what = (
                "was dropped from disk (unreadable or damaged)"
                if waits
                else "is not on disk either"
            )
            raise NotFound(f"{idents[0][0]}/{idents[0][1]} {what}")
        return promoted

    def promotion(
        self,
        idents: list[tuple[str, str]],
        present: Callable[[tuple], bool],
        again: Callable[[], Any],
    ) -> Deferred:
        """A request that found its object (or its prefix's next blocks) on disk only,
        answered once :meth:`promote` ends (through the pools' side it was bound to) by
        ``again()``: the request run again with this tier out of sight, so that what could
        not be promoted is not found, rather than promoted again and again. A single object
        that could not be promoted (``present`` says it is in no pool) says why instead."""
        link = self.link

        async def work() -> KVBrokerError | None:
            try:
                await self.promote(idents, link.reserve, link.seal, link.give_back)
            except KVBrokerError as exc:
                self.counters["promote_failures"] += 1
                return exc
            return None

        def then(failed: KVBrokerError | None) -> Any:
            if failed is not None and len(idents) == 1 and not present(idents[0]):
                raise failed
            self.hidden = True
            try:
                return again()
            finally:
                self.hidden = False

        return Deferred(work, then, PROMOTE_TIMEOUT)

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
        entries = entries[: len(leases)]
        t0 = time.perf_counter()
        reads = [
            loop.run_in_executor(self.store.pool, self._read_one, e, lease)
            for e, lease in zip(entries, leases, strict=True)
        ]
        results = await asyncio.gather(*reads, return_exceptions=True)
        good: list[Any] = []
        failed = False  # a chain is served up to its first block that cannot be
        unusable: PoolUnusable | None = None
        for e, lease, ok in zip(entries, leases, results, strict=True):
            e.reading -= 1
            if not failed and ok is True and not e.gone:
                good.append(lease)
                e.serial = lease.obj.serial  # the pool object it is a copy of, once sealed
                e.last_access = time.time()
                self.lru[e.ident] = e
                continue
            failed = True
            discard(lease)
            if isinstance(ok, PoolUnusable):  # the pool's fault: the disk copy stays
                self.counters["pool_errors"] += 1
                unusable = unusable or ok
                log.error("[tier.disk] %s/%s not promoted: %s", *e.ident, ok)
            elif isinstance(ok, BaseException):
                self.counters["read_errors"] += 1
                log.warning("[tier.disk] read of %s/%s failed: %s", *e.ident, ok)
                self.forget(e.ident)
            elif ok is False:
                self.counters["dropped_damaged"] += 1
                log.warning(
                    "[tier.disk] %s/%s: its slot does not hash to the digest "
                    "written; dropped, never served",
                    *e.ident,
                )
                self.forget(e.ident)
            if e.gone:
                if e.units and e.reading == 0:
                    self._release_slot(e)  # forgotten during the read
            else:
                self.lru[e.ident] = e
        if good:
            seal(good)
            # good: the chain up to its first failed read, a prefix of entries (linked now)
            for e, lease in zip(entries, good, strict=False):
                if not e.gone and lease.obj.linked:
                    self._pool_copy(e, lease.obj)
            self.counters["promoted"] += len(good)
            self.counters["promoted_bytes"] += sum(ls.obj.nbytes for ls in good)
            self.counters["promote_us"] += int((time.perf_counter() - t0) * 1e6)
        elif unusable is not None:
            raise NotFound(f"{entries[0].ident[0]}/{entries[0].ident[1]}: {unusable}")
        return len(good)

    def _read_one(self, e: DiskEntry, lease: Any) -> bool:
        """In an I/O thread: read the slot, and put its bytes in the lease's pages if they
        hash to the digest written (whether they did). Through a buffer of the daemon's own,
        never a mapping of the pool (:class:`~kvbroker._server.disk_store.PoolPages`)."""
        obj = lease.obj
        with self.store.scratch(e.length) as view:
            self.store.read(e.file, e.start, view)
            if xxhash.xxh3_64_intdigest(view) != e.digest:
                return False
            self.pools[obj.pool.index].write(obj.start * obj.pool.page_size, view)
            return True
