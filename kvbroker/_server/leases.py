"""The lease registry (one id space and one set of rules for every lease the daemon lends)
and the lease table (the live pool leases).

Pool leases, write arenas, ring leases (and sessions) take their ids from the one counter
here, so an id names one thing for the daemon's whole life and, through the journal's id
blocks, across warm restarts (*fencing*: see the ownership contract in
:mod:`kvbroker._server.state`). Each service keeps its live leases itself; this registry
remembers why ended ones ended and says, the same way for every kind of lease, what an id
that is no longer live means and what a lease held by another connection answers.

:class:`LeaseTable` owns the live pool leases: by id and by session, how many each uid
holds (against ``max_leases_per_*``), when each expires (a heap), which prefix leases are
lazy (:mod:`kvbroker._server.prefix_leases`), and the TTL rules.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import count
from typing import Any

from .._wire.stats import LeaseInfo
from ..errors import BadRequest, Forbidden, KVBrokerError, LeaseExpired, LimitExceeded
from .state import Lease, Session

__all__ = ["LeaseRegistry", "LeaseStatistics", "LeaseTable"]

_MAX_ENDED = 1 << 16  # reasons remembered; older ended ids answer "no lease"


class LeaseRegistry:
    """Lease ids (never reused) and why each ended lease ended."""

    def __init__(self) -> None:
        self._ids = count(1)
        self.first_id = 1  # ids below were handed out by an earlier daemon
        self._limit = 1 << 62  # without a journal nothing needs fencing
        self.journal: Any = None  # kvbroker._server.journal.Journal, when kept
        self.epoch = 1  # starts of this socket's daemon that adopted the previous one's pools
        self._ended: OrderedDict[int, str] = OrderedDict()

    def next_id(self) -> int:
        lid = next(self._ids)
        if lid >= self._limit:  # once per block of ids: a restart must not reuse them
            self._limit = self.journal.reserve_ids(lid)
        return lid

    def attach(self, journal: Any, next_id: int) -> None:
        """Continue from ``next_id`` (the journal's fence), ids journaled from now on."""
        self.journal = journal
        self.epoch = journal.epoch
        self.first_id = next_id
        self._ids = count(next_id)

    def take_next(self) -> int:
        """An id no lease will get, for a journal rewrite to fence from."""
        return next(self._ids)

    def fenced_up_to(self, limit: int) -> None:
        """The journal has reserved ids below ``limit``."""
        self._limit = limit

    def ended(self, lid: int, reason: str) -> None:
        self._ended[lid] = reason
        if len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)

    def gone(self, lid: int, what: str = "lease", *, fenced: bool = True) -> KVBrokerError:
        """The error for an id that names no live ``what``: LeaseExpired saying why it
        ended (or that it died with the previous daemon), else BadRequest. ``fenced``
        False: ids of an earlier daemon are not recognised (write arenas never were)."""
        reason = self._ended.get(lid)
        if reason is not None:
            return LeaseExpired(f"{what} {lid} has ended: {reason}")
        if fenced and 0 < lid < self.first_id:
            return LeaseExpired(
                f"{what} {lid} has ended: it died with the previous daemon, which restarted "
                f"(this is epoch {self.epoch})"
            )
        return BadRequest(f"no {what} {lid}")

    @staticmethod
    def foreign(lid: int, what: str = "lease") -> KVBrokerError:
        """The error for a live ``what`` that another connection holds."""
        return Forbidden(f"{what} {lid} is held by another connection")


@dataclass(frozen=True)
class LeaseStatistics:
    """The live leases: how many of each kind, and the latest ones in detail."""

    read: int
    write: int
    lazy: int  # prefix leases only their last blocks count as a reader
    recent: tuple[LeaseInfo, ...]
    per_session: dict[int, tuple[int, int]]  # session id -> (read leases, write leases)
    per_uid: dict[int, int]  # uid -> leases its sessions hold together
    scheduled: int  # entries of the expiry heap (live leases, and some ended or renewed)


class LeaseTable(Mapping[int, Lease]):
    """Every live pool lease (read and write): by id, by session, by uid, by expiry; read as
    a mapping of lease id -> :class:`~kvbroker._server.state.Lease`."""

    def __init__(
        self,
        registry: LeaseRegistry,
        clock: Callable[[], float],
        *,
        lease_ttl: float,
        max_lease_ttl: float,
        max_leases_per_client: int,
        max_leases_per_uid: int,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self.lease_ttl = lease_ttl
        self.max_lease_ttl = max_lease_ttl
        self.max_leases_per_client = max_leases_per_client
        # Leases of each uid's sessions together (a lease costs the daemon ~400 B of memory,
        # charged to no quota: many connections of one uid must not add up without bound)
        self.max_leases_per_uid = max_leases_per_uid
        self.leases: dict[int, Lease] = {}
        # Prefix leases pinning only their last blocks (kvbroker._server.prefix_leases).
        self.lazy: dict[int, Lease] = {}
        self.per_uid: Counter[int] = Counter()
        self._expiry: list[tuple[float, int]] = []

    def __getitem__(self, lid: int) -> Lease:
        return self.leases[lid]

    def __iter__(self) -> Iterator[int]:
        return iter(self.leases)

    def __len__(self) -> int:
        return len(self.leases)

    def __contains__(self, lid: object) -> bool:
        return lid in self.leases

    def ttl(self, asked: float | None) -> float:
        """A lease TTL asked for (in range: the op table's rule checked it), or the default."""
        return self.lease_ttl if asked is None else float(asked)

    def check_limit(self, session: Session) -> None:
        """LimitExceeded when ``session`` (or its uid) holds all the leases it may."""
        if len(session.leases) >= self.max_leases_per_client:
            raise LimitExceeded(
                f"session {session.id} ({session.name or 'pid ' + str(session.pid)}) holds "
                f"{len(session.leases)} leases, the most one connection may hold "
                "(max_leases_per_client): release some first"
            )
        held = self.per_uid.get(session.uid, 0)
        if held >= self.max_leases_per_uid:
            raise LimitExceeded(
                f"the connections of uid {session.uid} hold {held} leases together, the most "
                "one uid may hold (max_leases_per_uid): release some first"
            )

    def of(self, session: Session, lid: int, kind: str | None) -> Lease:
        """The live lease ``lid`` of this session (of ``kind``, unless None)."""
        ls = self.leases.get(lid)
        if ls is None:
            raise self.registry.gone(lid)
        if ls.session is not session:
            raise self.registry.foreign(lid)
        if kind is not None and ls.kind != kind:
            raise BadRequest(f"lease {lid} is a {ls.kind} lease, not a {kind} lease")
        return ls

    def lend(self, kind: str, session: Session, obj: Any, ttl: float, consume=False) -> Lease:
        """Owns: a new ``kind`` lease of ``session`` on ``obj``, expiring in ``ttl`` s.
        Frees: nothing (the caller pinned or reserved ``obj``)."""
        ls = Lease(self.registry.next_id(), kind, session, obj, ttl, self.clock() + ttl, consume)
        self.leases[ls.id] = ls
        session.leases[ls.id] = ls
        self.per_uid[session.uid] += 1
        self._expire_at(ls)
        return ls

    def make_lazy(self, ls: Lease, stride: int) -> None:
        """Owns: ``ls`` as a lazy prefix lease over ``stride`` interleaved chains."""
        ls.lazy = stride
        self.lazy[ls.id] = ls

    def unlazy(self, ls: Lease) -> None:
        """Frees: ``ls``'s place among the lazy leases (ended, or made eager)."""
        del self.lazy[ls.id]

    def renew(self, ls: Lease, ttl: float) -> None:
        """Owns: ``ls`` for ``ttl`` more seconds from now."""
        ls.ttl = ttl
        ls.expires_at = self.clock() + ttl
        self._expire_at(ls)

    def end(self, ls: Lease, reason: str) -> None:
        """Frees: ``ls`` (its id answers LeaseExpired with ``reason`` from now on); what it
        held is the caller's to release."""
        del self.leases[ls.id]
        ls.session.leases.pop(ls.id, None)
        uid = ls.session.uid
        if self.per_uid[uid] <= 1:
            del self.per_uid[uid]
        else:
            self.per_uid[uid] -= 1
        self.registry.ended(ls.id, reason)

    def due(self, now: float) -> Iterator[Lease]:
        """The live leases whose TTL passed by ``now``, earliest first (the caller ends each
        before the next is looked at)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            at, lid = heapq.heappop(expiry)
            ls = self.leases.get(lid)
            if ls is None or ls.expires_at != at:
                continue  # released, or renewed (a later heap entry stands for it)
            yield ls

    def _expire_at(self, ls: Lease) -> None:
        """Schedule ``ls``'s expiry. Entries of leases released or renewed since stay in the
        heap until due (up to max_lease_ttl away): past twice the live leases it is rebuilt
        from them, so renewals and claims with long TTLs cannot grow it without bound."""
        expiry = self._expiry
        heapq.heappush(expiry, (ls.expires_at, ls.id))
        if len(expiry) > 2 * len(self.leases) + 1024:
            expiry[:] = [(live.expires_at, live.id) for live in self.leases.values()]
            heapq.heapify(expiry)

    def pinned(self) -> set[int]:
        """Serials of the objects under a read lease (a lazy one's blocks all count)."""
        out: set[int] = set()
        for ls in self.leases.values():
            if ls.kind == "read":
                out.update(obj.serial for obj in ls.objects())
        return out

    def statistics(self, most: int = 256) -> LeaseStatistics:
        now = self.clock()
        reads = sum(1 for ls in self.leases.values() if ls.kind == "read")
        per_session: dict[int, tuple[int, int]] = {}
        for ls in self.leases.values():
            r, w = per_session.get(ls.session.id, (0, 0))
            per_session[ls.session.id] = (r + 1, w) if ls.kind == "read" else (r, w + 1)
        recent = tuple(
            LeaseInfo(
                lease=ls.id,
                kind=ls.kind,
                session=ls.session.id,
                namespace=ls.obj.namespace,
                key=ls.obj.key,
                nbytes=sum(o.nbytes for o in ls.objects()),
                expires_in=ls.expires_at - now,
            )
            for ls in list(self.leases.values())[-most:]
        )
        return LeaseStatistics(
            read=reads,
            write=len(self.leases) - reads,
            lazy=len(self.lazy),
            recent=recent,
            per_session=per_session,
            per_uid=dict(self.per_uid),
            scheduled=len(self._expiry),
        )
