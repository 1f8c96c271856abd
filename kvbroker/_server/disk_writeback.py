"""The disk tier's write-back (which pool objects get a copy on disk before they are
evicted), its quota shares and what the handlers ask of keys: parts of
:class:`~kvbroker._server.disk_tier.DiskTier`.

:class:`WriteBackPass` is the part of :class:`~kvbroker._server.disk_tier.DiskTier` that
looks at the pools' side: bound to the broker's LRU and to how the broker holds an object as
a reader while its copy is written (:meth:`bind`), it runs a pass soon after it is kicked (a
seal above the watermark, a write that ended, the daemon's tick). Policy ``evicted``: per
pool, the least recently used objects up to the bytes the pool holds above
``writeback_watermark``, so what the next evictions take is on disk already and an eviction
costs no write. Policy ``sealed``: every object sealed, soon after its seal.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .disk_entry import DiskEntry

__all__ = ["Queries", "QuotaShares", "WriteBackPass"]


class WriteBackPass:
    """Write-back of pool objects (a part of DiskTier: ``write_back``, ``copy_of``,
    ``inflight`` and the settings are the tier's)."""

    policy: str
    writeback_watermark: float
    writeback_inflight: int
    inflight: int
    pools: list
    entries: dict
    # and its methods copy_of, write_back and forget

    def __init__(self) -> None:
        self.link: Any = None  # the pools' side (bind)
        self._hold: Callable[[Any], None] = lambda obj: None
        self._release: Callable[[Any, bool], None] = lambda obj, oldest: None
        self._kicked = False
        self._to_write: deque[Any] = deque()  # policy sealed: sealed, not written yet
        # Pool objects held as readers while their copies are written (out of the LRU until
        # then): the pools' watermark waits for them rather than take a retained object.
        self.writing_back: set[Any] = set()
        self._pass_queue: list[Any] = []

    def bind(self, link: Any) -> None:
        """The pools' side (:class:`~kvbroker._server.disk_link.DiskLink`): their LRU, how
        to hold an object while its copy is written, how to reserve and seal a promotion."""
        self.link = link
        self._hold, self._release = link.hold, link.release

    def sealed(self, obj: Any) -> None:
        """``obj`` was sealed in a pool: a disk copy of an older object of its key goes;
        with policy ``sealed``, its own copy is written soon."""
        e = self.entries.get((obj.namespace, obj.key))
        if e is not None and e.serial != obj.serial:
            self.forget(e.ident)
        if self.policy == "sealed" and self.copy_of(obj) is None:
            self._to_write.append(obj)
            self.kick()
        elif self._above_watermark(obj.pool):
            self.kick()

    def _above_watermark(self, pool: Any) -> bool:
        a = pool.allocator
        return a.used > self.writeback_watermark * a.capacity

    def kick(self) -> None:
        """Run a write-back pass soon (once, however often it is kicked meanwhile)."""
        if not self._kicked and self.link is not None:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._write_back_pass)

    def _write_back_pass(self) -> None:
        """Write copies of what the pools will evict first: per pool, its least recently
        used objects up to the bytes it holds above ``writeback_watermark`` (those already
        on disk count); with policy ``sealed``, the objects sealed since, first."""
        self._kicked = False
        while self._to_write and self.inflight < self.writeback_inflight:
            obj = self._to_write.popleft()
            # Any linked object, not only those in the LRU: a chain's parents (out of it
            # while they have children) and sessions' retained blocks must survive a reboot
            # too. Holding one as a reader is safe whatever it is (a lease's, a parent, a
            # retained block): releasing it puts back only what belongs in the LRU.
            if obj.linked and self.copy_of(obj) is None:
                self._write_held(obj, oldest=False)
        above: dict[int, int] = {}
        for obj in self.link.evictable():
            if self.inflight >= self.writeback_inflight:
                break
            pool = obj.pool
            left = above.get(pool.index)
            if left is None:
                a = pool.allocator
                left = (a.used - int(self.writeback_watermark * a.capacity)) * pool.page_size
            if left <= 0:  # this pool's share is covered (or it is below the watermark)
                above[pool.index] = 0
                if len(above) == len(self.pools) and not any(above.values()):
                    break
                continue
            above[pool.index] = max(0, left - obj.npages * pool.page_size)
            if self.copy_of(obj) is None:
                self._pass_queue.append(obj)
        queue, self._pass_queue = self._pass_queue, []
        for obj in queue:  # (not while iterating the LRU: holding takes them out of it)
            self._write_held(obj, oldest=True)

    def _write_held(self, obj: Any, oldest: bool) -> None:
        self._hold(obj)
        self.writing_back.add(obj)

        def done() -> None:
            self.writing_back.discard(obj)
            self._release(obj, oldest)

        if not self.write_back(obj, done):
            done()


class QuotaShares:
    """Each quota account's share of the disk (a part of DiskTier): its ``[quotas]`` limit
    in the pools scaled by ``quota_scale`` (disk size / pool size), what its entries hold,
    and room made by dropping its own least recently used entries (``_evict_oldest``)."""

    usage: Counter
    quota_of: Callable[[Any], int | None]
    quota_scale: float
    # and its method _evict_oldest

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


class Queries:
    """What the handlers ask the tier of keys (a part of DiskTier: ``entries``, ``has`` and
    ``promotion`` are the tier's)."""

    entries: dict
    # and its methods has and promotion

    def lookup(self, ident: tuple[str, str]) -> dict[str, Any]:
        """``lookup``'s answer for an object on disk only (pool -1)."""
        return self.entries[ident].lookup()

    def run(self, namespace: str, keys: Iterable[str], in_pool: Callable[[tuple], bool]) -> int:
        """How many of ``keys``, from the first, are in a pool or here (a key that is not a
        string never is: a request's keys are whatever its sender put in the list)."""
        n = 0
        for key in keys:
            ident = (namespace, key)
            if key.__class__ is not str or not (in_pool(ident) or self.has(ident)):
                break
            n += 1
        return n

    def run_after(
        self,
        namespace: str,
        keys: list,
        start: int,
        present: Callable[[tuple], bool],
        hold: bool,
        again: Callable[[], Any],
    ) -> int:
        """A prefix match's run past its first ``start`` blocks (in a pool): how many of the
        next ``keys`` are here or in a pool (``present``). Held, those here only are promoted
        first: a :meth:`promotion` raised, answered by ``again``."""
        if start >= len(keys) or keys[start].__class__ is not str:
            return 0
        rest = keys[start:]
        n = self.run(namespace, rest, present)
        if n and hold:
            raise self.promotion(
                [(namespace, k) for k in rest[:n] if not present((namespace, k))], present, again
            )
        return n
