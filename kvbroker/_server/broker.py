"""The broker: the daemon's state behind one face, and the dispatch of requests.

:class:`Broker` is the :class:`~kvbroker._server.transitions.Transitions` of the owners of
the state (directory, lease table, pages, accounts, arenas) with what faces the daemon: each
request routed to its op's handler (:mod:`kvbroker._server.handlers`, derived from the op
table ``kvbroker._wire.protocol.OPS``: the ``service`` column), the statistics composed from
the owners' own (:mod:`kvbroker._server.snapshot`), the journal and the warm restart
(:mod:`kvbroker._server.restore`). Who owns and frees what: the ownership contract in
:mod:`kvbroker._server.state`. No I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .handlers import Handlers
from .restore import plan as restore_plan
from .snapshot import BriefStatistics
from .state import Lease, Session, StoredObject, WouldWait
from .transitions import Transitions

__all__ = ["Broker", "Session", "WouldWait"]


class Broker(Transitions):
    """The transitions of the daemon's state, with its requests, statistics and journal;
    the daemon drives it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers = Handlers(self)  # one per op row the broker serves

    # ------------------------------------------------------------------ views
    @property
    def objects(self) -> dict[tuple[str, str], StoredObject]:
        """The sealed objects by (namespace, key) (the directory's; read only)."""
        return self.directory.objects

    @property
    def pending(self) -> dict[tuple[str, str], StoredObject]:
        """The reservations being written by (namespace, key) (read only)."""
        return self.directory.pending

    @property
    def by_namespace(self) -> dict[str, dict[str, StoredObject]]:
        return self.directory.by_namespace

    @property
    def lazy_leases(self) -> dict[int, Lease]:
        return self.leases.lazy

    @property
    def epoch(self) -> int:
        return self.registry.epoch

    def brief_statistics(self) -> BriefStatistics:
        """The counts of :meth:`statistics` a status line shows, without its walks."""
        used, capacity = self.pages.usage()
        return BriefStatistics(
            clients=len(self.sessions),
            objects=len(self.directory.objects),
            leases=len(self.leases),
            used=used,
            capacity=capacity,
        )

    # ------------------------------------------------------------------ requests
    def handle(self, session: Session, op: str, raw_args: Any, daemon: Any = None) -> Any:
        """Run one request; returns its result or raises a KVBrokerError (or WouldWait).
        ``daemon``: what answers the ops the table gives the daemon (the connection)."""
        return self._handlers.handle(session, op, raw_args, daemon)

    # ------------------------------------------------------------------ warm restart
    def attach_journal(self, journal: Any, next_id: int) -> None:
        """Journal every change of the index from now on; ids continue from ``next_id``."""
        self.journal = journal
        self.registry.attach(journal, next_id)
        journal.rewrite(self.directory.records(), next_id, self.pages.lent_extents())
        self.registry.fenced_up_to(journal.id_limit)

    def compact_journal(self) -> None:
        """Rewrite the journal as the live objects only (the daemon calls this off the
        request path, when the log has grown to twice what is live)."""
        records, lent = self.directory.records(), self.pages.lent_extents()
        self.journal.rewrite(records, self.registry.take_next(), lent)
        self.registry.fenced_up_to(self.journal.id_limit)

    def journal_lent(self) -> list[tuple[int, int, int]]:
        """Every extent lent for writing or quarantined (a restart quarantines them)."""
        return self.pages.lent_extents()

    def restore(
        self,
        records: Iterable[dict[str, Any]],
        lent: Iterable[tuple[int, int, int]] = (),
        sessions: Iterable[dict[str, Any]] = (),
        **checks: Any,
    ) -> int:
        """Owns: the sealed objects of a previous daemon that ``restore.plan`` keeps (its
        ``checks``: ``report``, ``dropped``, ``verify``), charged, in the pools' allocators;
        the pages it had lent for writing, in the timed quarantine; then what its
        ``sessions`` (their journal records) retained of those objects. Returns how many
        objects came back."""
        if self.objects or self.pending:
            raise RuntimeError("restore needs an empty broker")
        adopted = restore_plan(records, self.pools, self.pages.pools_for, lent, **checks)
        by_serial: dict[int, StoredObject] = {}
        for obj, parent_serial in adopted.survivors:
            self.directory.adopt(obj, by_serial.get(parent_serial))
            by_serial[obj.serial] = obj
            self.pages.take(obj.pool, obj.start, obj)
            nbytes = obj.npages * obj.pool.page_size
            obj.charged = self.accounts.charge(obj.namespace, nbytes, False, obj.tenants)
        for pool, extents in zip(self.pools, adopted.live, strict=True):
            pool.rebuild(extents)
        for idx, start, npages in adopted.held:
            self.pages.hold(self.pools[idx], start, npages)
        self.directory.serials_from(adopted.top_serial + 1)
        self.retention.restore(sessions, by_serial)
        return len(by_serial)
