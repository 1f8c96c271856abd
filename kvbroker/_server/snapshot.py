"""The daemon's statistics: the owners' own statistics composed into the frozen types of
:mod:`kvbroker._wire.stats` (trio's ``statistics()`` style).

Each owner builds its part (:meth:`Directory.statistics`, :meth:`LeaseTable.statistics`,
:meth:`Pages.statistics`, :meth:`Accounts.statistics`, :meth:`Arenas.statistics`,
:meth:`Session.statistics`, the rings' and the fleet's); :func:`compose` puts them
together, :func:`as_seen_by` leaves out what one connection may not see. ``stat`` and
``watch`` send :meth:`Statistics.to_dict`; the Prometheus endpoint
(:mod:`kvbroker._server.metrics`) reads the same objects. What the figures mean (leased,
quarantined, ...): see the ownership contract in :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable

from .._version import __version__
from .._wire.stats import (
    DiskTierStatistics,
    ClientStatistics,
    Counters,
    EventStatistics,
    NamespaceUsage,
    PoolStatistics,
    RetentionStatistics,
    RingStatistics,
    SessionInfo,
    Statistics,
    TransferRecord,
    TransferStatistics,
)
from .accounts import AccountStatistics
from .arenas import ArenaStatistics
from .directory import DirectoryStatistics
from .leases import LeaseStatistics
from .state import Session

__all__ = ["BriefStatistics", "as_seen_by", "compose"]

_MAX_NAMESPACES = 1000  # rows of per-namespace usage in a snapshot


@dataclasses.dataclass(frozen=True)
class BriefStatistics:
    """A few figures of :class:`Statistics`, each owner's count taken in constant time: for
    systemd's status line every few seconds, where ``statistics()`` walks every object
    (0.2 s for 200,000 of them)."""

    clients: int  # sessions, the daemon's own (the disk tier's promoter) included
    objects: int  # sealed
    leases: int  # read and write
    used: int  # bytes of the pools in use
    capacity: int  # bytes of the pools


def compose(
    *,
    started_at: float,
    socket: str,
    directory: DirectoryStatistics,
    leases: LeaseStatistics,
    pools: tuple[PoolStatistics, ...],
    accounts: AccountStatistics,
    arenas: ArenaStatistics,
    clients: Iterable[ClientStatistics],
    counters: dict[str, int],
    transfers: Iterable[tuple],
    read_replicas: int,
    rings: tuple[RingStatistics, ...],
    transfer: TransferStatistics | None,
    events: EventStatistics | None,
    retention: RetentionStatistics | None,
    disk: DiskTierStatistics | None = None,
) -> Statistics:
    """Everything the daemon can say about itself, as an operator (admin) sees it."""
    return Statistics(
        taken_at=time.time(),
        version=__version__,
        pid=os.getpid(),
        started_at=started_at,
        socket=socket,
        objects=directory.objects,
        pending=directory.pending,
        read_leases=leases.read,
        write_leases=leases.write,
        arenas=arenas.arenas,
        read_replicas=read_replicas,
        pools=pools,
        clients=tuple(clients),
        counters=Counters(**counters),
        leases=leases.recent,
        transfers=tuple(TransferRecord(*t) for t in transfers),
        namespaces=_namespace_usage(directory, accounts),
        rings=rings,
        transfer=transfer,
        events=events,
        retention=retention,
        disk=disk,
    )


def as_seen_by(
    snap: Statistics,
    session: Session,
    directory: DirectoryStatistics,
    named: Callable[[int], bool],
    last_failure: Callable[[Callable[[str], bool]], str] | None,
    largest_sessions: Callable[[Callable[[str], bool]], tuple[SessionInfo, ...]],
) -> Statistics:
    """The statistics as this connection may see them: under a tenant policy, the names of
    namespaces it cannot read (their objects, leases, transfers, usage) and other users'
    connections are left out, and so is the segment name of another tenant's pool
    (``named``: whether it may know pool i's, as in hello); pool-wide figures and counters
    stay. ``last_failure``: the fleet's latest failed pull a namespace filter admits;
    ``largest_sessions``: the largest sessions of the namespaces a filter admits (not the
    daemon's largest with the others' left out: a tenant would see none of its own behind
    another's many bigger ones)."""
    access = session.access
    if access.admin:
        return snap
    can = access.can
    pools = tuple(p if named(p.index) else dataclasses.replace(p, name="") for p in snap.pools)
    transfer = snap.transfer
    if transfer is not None and last_failure is not None:  # its message names its keys
        transfer = dataclasses.replace(transfer, last_failure=last_failure(can))
    retention = snap.retention
    if retention is not None:  # another tenant's sessions are invisible, like its names
        retention = dataclasses.replace(retention, largest=largest_sessions(can))
    return dataclasses.replace(
        snap,
        retention=retention,
        pools=pools,
        transfer=transfer,
        objects=sum(n for ns, (n, _) in directory.namespaces.items() if can(ns)),
        pending=sum(1 for ns in directory.pending_namespaces if can(ns)),
        leases=tuple(x for x in snap.leases if can(x.namespace)),
        transfers=tuple(x for x in snap.transfers if can(x.namespace)),
        clients=tuple(c for c in snap.clients if c.uid == session.uid),
        namespaces=tuple(x for x in snap.namespaces if can(x.namespace)),
    )


def _namespace_usage(
    directory: DirectoryStatistics, accounts: AccountStatistics, top: int = _MAX_NAMESPACES
) -> tuple[NamespaceUsage, ...]:
    """Per namespace: sealed objects, their bytes, bytes charged, quota (largest first)."""
    held = directory.namespaces
    rows = [
        NamespaceUsage(
            namespace=ns,
            objects=held.get(ns, (0, 0))[0],
            bytes=held.get(ns, (0, 0))[1],
            used=accounts.namespaces.get(ns, 0),
            quota=accounts.quotas.get(ns),
        )
        for ns in set(held) | set(accounts.namespaces)
    ]
    rows.sort(key=lambda r: (-r.used, r.namespace))
    return tuple(rows[:top])
