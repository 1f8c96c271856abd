"""Extent allocator over the pages of one pool.

Best fit by size (ties: lowest address), neighbours coalesce on free. Every operation is
O(log n) searches plus list inserts, so the directory stays flat up to millions of extents.
It refuses to double-free or free a range it never handed out, so a bookkeeping bug shows up
as an exception rather than as two owners of one page.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class ExtentAllocator:
    """Hands out ``(start, npages)`` extents of ``[0, capacity)`` that never overlap."""

    __slots__ = ("capacity", "_free_by_start", "_free_by_end", "_free_sizes", "_live", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._free_by_start: dict[int, int] = {0: capacity}
        self._free_by_end: dict[int, int] = {capacity: 0}
        self._free_sizes: list[tuple[int, int]] = [(capacity, 0)]
        self._live: dict[int, int] = {}
        self._used = 0

    @classmethod
    def with_live(cls, capacity: int, live: list[tuple[int, int]]) -> ExtentAllocator:
        """An allocator whose live extents are exactly ``live`` (a warm restart rebuilding a
        dead daemon's state); everything between them is free. Overlaps raise ValueError."""
        a = cls(capacity)
        a._free_by_start.clear()
        a._free_by_end.clear()
        a._free_sizes.clear()
        pos = 0
        for start, npages in sorted(live):
            if npages <= 0 or start < pos or start + npages > capacity:
                raise ValueError(f"extent ({start}, {npages}) overlaps another or the end")
            if start > pos:
                a._add_free(pos, start - pos)
            a._live[start] = npages
            a._used += npages
            pos = start + npages
        if pos < capacity:
            a._add_free(pos, capacity - pos)
        return a

    # -- queries --------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        return self._free_sizes[-1][0] if self._free_sizes else 0

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free space: 0 when all free space is one run."""
        free = self.free
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def free_extents(self) -> list[tuple[int, int]]:
        return sorted(self._free_by_start.items())

    def live_extents(self) -> list[tuple[int, int]]:
        return sorted(self._live.items())

    def can_fit(self, npages: int) -> bool:
        return 0 < npages <= self.largest_free

    # -- changes --------------------------------------------------------------------------
    def alloc(self, npages: int) -> int | None:
        """Start page of a fresh extent of ``npages``, or None when no free run is that long."""
        if npages <= 0:
            raise ValueError("npages must be positive")
        i = bisect_left(self._free_sizes, (npages, -1))
        if i == len(self._free_sizes):
            return None
        size, start = self._free_sizes.pop(i)
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        if size > npages:
            self._add_free(start + npages, size - npages)
        self._live[start] = npages
        self._used += npages
        return start

    def split(self, start: int, npages: int, head: int) -> int:
        """Cut the live extent ``(start, npages)`` into two live extents, ``(start, head)``
        and the rest; returns the rest's start. Nothing is freed or allocated (a write arena
        hands its first pages to an object this way)."""
        if self._live.get(start) != npages:
            raise ValueError(f"extent ({start}, {npages}) is not live")
        if not 0 < head < npages:
            raise ValueError(f"cannot split {npages} pages after {head}")
        self._live[start] = head
        self._live[start + head] = npages - head
        return start + head

    def free_extent(self, start: int, npages: int) -> None:
        if self._live.get(start) != npages:
            raise ValueError(f"extent ({start}, {npages}) is not live")
        del self._live[start]
        self._used -= npages
        end = start + npages
        before = self._free_by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after = self._free_by_start.get(end)
        if after is not None:
            self._remove_free(end, after)
            end += after
        self._add_free(start, end - start)

    def _add_free(self, start: int, size: int) -> None:
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start
        insort(self._free_sizes, (size, start))

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        i = bisect_left(self._free_sizes, (size, start))
        del self._free_sizes[i]
