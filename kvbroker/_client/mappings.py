"""A client's mappings of the daemon's host pools: one per pool per process.

The daemon creates the segments (:mod:`kvbroker._server.pool`); a client maps each pool once
per process with ``MAP_POPULATE`` so the first transfers do not pay a page fault per 4 KiB
page.
"""

from __future__ import annotations

import mmap

import posix_ipc

__all__ = ["PoolMapping"]


class PoolMapping:
    """A client's one mapping of a pool, populated at map time."""

    __slots__ = ("index", "name", "size", "mm")

    def __init__(self, index: int, name: str, size: int) -> None:
        self.index = index
        self.name = name
        self.size = size
        shm = posix_ipc.SharedMemory(name)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(shm.fd, size, flags=flags)
        finally:
            shm.close_fd()

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A caller still holds a view past its lease; the mapping goes with the last one.
            pass
