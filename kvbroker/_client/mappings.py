"""A client's mappings of the daemon's host pools: one per pool per process.

The daemon creates the segments (:mod:`kvbroker._server.pool`); a client maps each pool once
per process with ``MAP_POPULATE`` so the first transfers do not pay a page fault per 4 KiB
page.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import posix_ipc

from ..errors import BrokerUnavailable, Forbidden
from .shared import PerProcess

__all__ = ["PoolMapping", "ClientMappings", "process_maps"]


class PoolMapping:
    """A client's one mapping of a pool, populated at map time."""

    __slots__ = ("index", "name", "size", "mm", "_writable", "_readonly")

    def __init__(self, index: int, name: str, size: int) -> None:
        self.index = index
        self.name = name
        self.size = size
        # The whole pool as uint8 arrays, made on first use: a lease's view is a slice of
        # one (a tenth of the time of a numpy.frombuffer of the mapping per view).
        self._writable: Any = None
        self._readonly: Any = None
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise BrokerUnavailable(
                f"pool {index}'s shared memory {name} is gone (unlinked under the daemon, "
                "which logs POOL LOST): restart the daemon"
            ) from None
        except posix_ipc.PermissionsError:
            raise Forbidden(
                f"pool {index} ({name}) may not be mapped by uid {os.getuid()}: it belongs "
                "to another tenant"
            ) from None
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(shm.fd, size, flags=flags)
        finally:
            shm.close_fd()

    def view(self, offset: int, nbytes: int, writable: bool) -> Any:
        """A uint8 numpy array over ``nbytes`` of the pool from ``offset`` (read-only unless
        ``writable``); ValueError when that runs past the pool."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"extent ({offset}, {nbytes}) runs past pool {self.index} ({self.size} bytes)"
            )
        whole = self._writable if writable else self._readonly
        if whole is None:
            import numpy as np

            self._writable = np.frombuffer(self.mm, dtype=np.uint8)
            # over a read-only buffer: a reader cannot make its view writable again
            self._readonly = np.frombuffer(memoryview(self.mm).toreadonly(), dtype=np.uint8)
            whole = self._writable if writable else self._readonly
        return whole[offset : offset + nbytes]

    def close(self) -> None:
        # Our arrays first: a view still held elsewhere keeps the mapping (BufferError below).
        self._writable = self._readonly = None
        try:
            self.mm.close()
        except BufferError:
            # A caller still holds a view past its lease; the mapping goes with the last one.
            pass


# segment name -> this process's one mapping of it, shared by every client in the process
process_maps: PerProcess[PoolMapping] = PerProcess(PoolMapping.close)


class ClientMappings:
    """The pools one client has mapped, pool index -> the process's one mapping of it.

    A client holds each pool's mapping from its first use until :meth:`release_all` (its
    close, or a cold restart of the daemon that made new segments). Threads of one client may
    map at once: a pool is acquired once per client (two first uses racing would hold it
    twice, and the extra hold would keep it mapped for good)."""

    __slots__ = ("_held", "_lock")

    def __init__(self) -> None:
        self._held: dict[int, PoolMapping] = {}
        self._lock = threading.Lock()

    def get(self, index: int, pools: list[dict]) -> PoolMapping:
        """The mapping of pool ``index`` of ``pools`` (the hello reply's), mapped on first use."""
        m = self._held.get(index)
        if m is not None:
            return m
        with self._lock:
            m = self._held.get(index)
            if m is None:
                p = pools[index]
                if p.get("hidden"):
                    raise Forbidden(
                        f"pool {index} belongs to another tenant ([tenant_pools]): "
                        f"uid {os.getuid()} may not map it"
                    )
                m = self._held[index] = process_maps.acquire(
                    p["name"], lambda: PoolMapping(index, p["name"], p["size"])
                )
        return m

    def release_all(self) -> None:
        with self._lock:
            for m in self._held.values():
                process_maps.release(m.name)
            self._held.clear()

    def after_fork(self) -> None:
        """In a forked child: the lock may be held by a thread the child does not have."""
        self._lock = threading.Lock()
