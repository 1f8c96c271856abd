"""What the daemon offers the parts it hosts: :class:`DaemonView`.

A connection, the fleet, its event feed and the read replicas each take the running daemon;
they depend on this description of it, not on :mod:`kvbroker._server.daemon` (which imports
them): the structure of ``kvbroker._server`` stays without circles
(``python -m kvbroker._server.structure``). :class:`~kvbroker._server.daemon.Daemon` is one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .broker import Broker
    from .config import DaemonConfig

__all__ = ["DaemonView"]


class DaemonView(Protocol):
    """The running daemon as its connections, fleet and replicas see it."""

    config: DaemonConfig
    broker: Broker | None
    fleet: Any  # kvbroker._server.fleet.Fleet, with [transfer] or [events]
    connections: set[Any]  # the open kvbroker._server.connection.Connection objects
    per_uid: dict[int, int]  # open connections per peer uid
    draining: bool

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    @property
    def keeps_pools(self) -> bool: ...

    def loop_time(self) -> float: ...

    def note_activity(self) -> None: ...

    def forget(self, conn: Any) -> None: ...

    def backlogged(self, conn: Any) -> None: ...

    def add_waiter(self, key: tuple[str, str], conn: Any) -> None: ...

    def remove_waiter(self, key: tuple[str, str], conn: Any) -> None: ...
