"""The strict staging-ring allocator (docs/design.md), pure Python, thread-safe.

Who owns and frees what: the ring owns only offsets (the memory behind them belongs to
whoever created the ring). :meth:`RingAllocator.alloc` hands the caller a :class:`Region`; the
caller must :meth:`~RingAllocator.free` it exactly once, on every path, aborts included (use
``with ring.region(n) as r:``, which frees on exit). A region is never handed out while it
overlaps a live one: space is recycled FIFO, the frontier advancing only past a contiguous
prefix of freed regions in allocation order; a request that fits neither before the end nor
at offset 0 waits (bounded) for that frontier to move. An empty ring restarts at offset 0.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import KVBrokerError, Timeout

__all__ = ["RingAllocator", "Region", "RingOversize"]


class RingOversize(KVBrokerError):
    """The request is larger than the ring: no amount of waiting can satisfy it."""


@dataclass(eq=False)
class Region:
    offset: int
    size: int
    freed: bool = field(default=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.size


class RingAllocator:
    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"ring size must be positive, got {size}")
        self.size = size
        self._live: deque[Region] = deque()  # allocation order; freed ones wait for the prefix
        self._head = 0
        self._cond = threading.Condition()

    def _try(self, n: int) -> Region | None:
        if not self._live:
            self._head = 0
            return Region(0, n)
        tail = self._live[0].offset
        wrapped = self._live[-1].offset < tail
        if not wrapped:
            if self._head + n <= self.size:
                return Region(self._head, n)
            if n <= tail:
                return Region(0, n)  # wrap: the space between head and the end is wasted
            return None
        return Region(self._head, n) if self._head + n <= tail else None

    def alloc(self, n: int, timeout: float | None = 0.0) -> Region:
        """A region of ``n`` bytes; waits at most ``timeout`` seconds (None: forever) for space."""
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        if n > self.size:
            raise RingOversize(f"{n} bytes can never fit in a ring of {self.size} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                r = self._try(n)
                if r is not None:
                    self._live.append(r)
                    self._head = r.end
                    return r
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise Timeout(
                        f"no {n} contiguous free bytes in the ring within {timeout} s "
                        f"({self.used} of {self.size} bytes held by {len(self._live)} regions)"
                    )
                self._cond.wait(left)

    def free(self, region: Region) -> None:
        with self._cond:
            if region.freed:
                raise KVBrokerError(f"region at {region.offset} freed twice")
            region.freed = True
            while self._live and self._live[0].freed:
                self._live.popleft()
            if not self._live:
                self._head = 0
            self._cond.notify_all()

    @contextlib.contextmanager
    def region(self, n: int, timeout: float | None = 0.0):
        r = self.alloc(n, timeout)
        try:
            yield r
        finally:
            self.free(r)

    @property
    def used(self) -> int:
        """Bytes not yet reusable (live regions and freed ones behind the FIFO frontier)."""
        with self._cond:
            return sum(r.size for r in self._live)

    @property
    def largest_free(self) -> int:
        """The largest request that would be granted now without waiting."""
        with self._cond:
            if not self._live:
                return self.size
            tail = self._live[0].offset
            if self._live[-1].offset < tail:  # wrapped: only the gap up to the oldest region
                return tail - self._head
            return max(self.size - self._head, tail)

    def held(self) -> list[Region]:
        """Every region not yet reusable, in allocation order (freed ones behind the frontier
        included: their ``freed`` is True)."""
        with self._cond:
            return list(self._live)

    def live(self) -> list[Region]:
        with self._cond:
            return [r for r in self._live if not r.freed]
