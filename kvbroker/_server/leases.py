"""The lease registry: one id space and one set of rules for every lease the daemon lends.

Pool leases, write arenas, ring leases (and sessions) take their ids from the one counter
here, so an id names one thing for the daemon's whole life and, through the journal's id
blocks, across warm restarts (*fencing*: see the ownership contract in
:mod:`kvbroker._server.state`). Each service keeps its live leases itself; this registry
remembers why ended ones ended and says, the same way for every kind of lease, what an id
that is no longer live means and what a lease held by another connection answers.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Any

from ..errors import BadRequest, Forbidden, KVBrokerError, LeaseExpired

__all__ = ["LeaseRegistry"]

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
