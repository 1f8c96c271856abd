"""Where the monitor's data comes from: an interface, and the daemon behind it.

The App only ever sees :class:`MonitorSource`, so tests hand it a fake that feeds fixed
snapshots, and the screen never knows whether a daemon is there.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import NamedTuple

from kvbroker._wire.paths import default_socket_path
from kvbroker._wire.stats import ObjectInfo, Statistics
from kvbroker.errors import BrokerUnavailable

from ._wire import AsyncSession

__all__ = ["MonitorSource", "DaemonSource", "Evicted"]


class Evicted(NamedTuple):
    """What one evict freed; leased objects are kept by the daemon, and said so here."""

    count: int
    nbytes: int
    skipped_leased: int


class MonitorSource(ABC):
    """A stream of snapshots plus the few admin calls the objects view needs.

    Every method may raise :class:`~kvbroker.errors.BrokerUnavailable`; the App then shows
    the disconnected state and calls :meth:`connect` again after a pause.
    """

    #: What the status line names as the other end (a socket path, "fake", ...).
    label: str = ""

    @abstractmethod
    async def connect(self, interval: float) -> None:
        """(Re)open the stream of snapshots, one every ``interval`` seconds."""

    @abstractmethod
    async def next_snapshot(self) -> Statistics:
        """Wait for the next snapshot."""

    @abstractmethod
    async def list_objects(self, match: str | None, limit: int) -> list[ObjectInfo]:
        """Sealed objects whose key matches the regex ``match``."""

    @abstractmethod
    async def evict(self, namespace: str, key: str) -> Evicted:
        """Evict one object (the daemon keeps it while it is leased)."""

    @abstractmethod
    async def close(self) -> None:
        """Drop the connection; :meth:`connect` may be called again afterwards."""


class DaemonSource(MonitorSource):
    """The daemon's ``watch`` push stream on one connection, which also carries admin calls."""

    def __init__(self, socket_path: str | None = None) -> None:
        self.label = socket_path or default_socket_path()
        self._conn: AsyncSession | None = None

    async def connect(self, interval: float) -> None:
        await self.close()
        conn = await AsyncSession.open(self.label, name=f"kvbroker-tui:{os.getpid()}")
        try:
            await conn.ops.watch(interval)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    def _connected(self) -> AsyncSession:
        if self._conn is None:
            raise BrokerUnavailable(f"not connected to {self.label}")
        return self._conn

    async def next_snapshot(self) -> Statistics:
        msg = await self._connected().next_push()
        return Statistics.from_dict(msg["result"])

    async def list_objects(self, match: str | None, limit: int) -> list[ObjectInfo]:
        reply = await self._connected().ops.list(match=match, limit=limit)
        return [ObjectInfo.from_dict(o) for o in reply["objects"]]

    async def evict(self, namespace: str, key: str) -> Evicted:
        reply = await self._connected().ops.evict(namespace=namespace, key=key)
        return Evicted(int(reply["count"]), int(reply["bytes"]), int(reply["skipped_leased"]))

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
