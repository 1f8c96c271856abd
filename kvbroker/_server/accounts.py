"""Quota accounting: the bytes each namespace and each tenant account is charged, and the
room a write over a quota makes by evicting that account's own objects.

:class:`Accounts` keeps the charges against the ``[quotas]`` limits
(:class:`~kvbroker._server.policy.Quotas`): a namespace's, and with tenant quotas a user's
(``("user", uid)``) and a group's (``("group", gid)``). What is charged and when it is
uncharged follows the pages (an object's, a write arena's, quarantined pages' until their
writer is gone): the ownership contract in :mod:`kvbroker._server.state`.
:class:`~kvbroker._server.broker.Broker` composes it; it evicts through the broker's LRU.
No I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import QuotaExceeded
from .policy import Quotas, user_name

if TYPE_CHECKING:
    from .retention import Retention
    from .state import Session, StoredObject

__all__ = ["Accounts"]


class Accounts:
    """Bytes charged per namespace and tenant account, against the quotas."""

    def __init__(self, quotas: Quotas, lru: OrderedDict[int, StoredObject],
                 evict: Callable[[StoredObject], None],
                 retention: Retention | None = None) -> None:  # fmt: skip
        self.quotas = quotas
        # namespace (or tenant account, ("user", uid) / ("group", gid)) -> bytes charged
        self.usage: dict[Any, int] = {}
        self._lru = lru  # sealed, linked, unleased objects, least recently used first
        self._evict = evict
        self._retention = retention  # sessions' retained objects, evicted after the LRU's

    def tenants_of(self, session: Session) -> tuple[tuple[str, int], ...]:
        """The tenant accounts ``session``'s writes are charged to (none without tenant
        quotas)."""
        return self.quotas.tenants(session.uid, session.access.gids) if self.quotas else ()

    def charge(self, namespace: str | None, nbytes: int, enforce: bool = True,
               tenants: tuple[tuple[str, int], ...] = ()) -> int:  # fmt: skip
        """Count ``nbytes`` against ``namespace`` (None: none) and each tenant account; over
        a quota, evict that namespace's (or tenant's) own least recently used unleased
        objects first, then raise QuotaExceeded (charging nothing). Returns the bytes
        charged (the caller stores them on the object, freeing uncharges them)."""
        accounts = ([namespace] if namespace is not None else []) + list(tenants)
        if enforce and self.quotas:
            for account in accounts:
                self._make_room(account, nbytes)
        for account in accounts:
            self.usage[account] = self.usage.get(account, 0) + nbytes
        return nbytes

    def _make_room(self, account: Any, nbytes: int) -> None:
        if isinstance(account, tuple):
            limit = self.quotas.tenant_limit(account)
            kind, ident = account
            what = f"{kind} {user_name(ident) if kind == 'user' else ident}"

            def owned(o: StoredObject) -> bool:
                return account in o.tenants
        else:
            limit = self.quotas.limit(account)
            what = f"namespace {account!r}"

            def owned(o: StoredObject) -> bool:
                return o.namespace == account
        used = self.usage.get(account, 0)
        if limit is None or used + nbytes <= limit:
            return
        mine = [o for o in self._lru.values() if owned(o)]
        if self._retention is not None:  # a quota is hard: retained objects go last
            mine += [o for o in self._retention.victims() if owned(o)]
        evictable = sum(o.charged for o in mine)
        if used - evictable + nbytes > limit:
            raise QuotaExceeded(
                f"{what}: {nbytes} more bytes would make {used + nbytes} of its quota of "
                f"{limit} ({used} used, {evictable} of them evictable); free some (release "
                "leases, evict, abort write arenas) or raise [quotas]"
            )
        for obj in mine:
            if self.usage.get(account, 0) + nbytes <= limit:
                break
            if self._retention is not None:
                self._retention.evicted_now(obj, "quota")
            self._evict(obj)

    def uncharge(self, namespace: Any, nbytes: int,
                 tenants: tuple[tuple[str, int], ...] = ()) -> None:  # fmt: skip
        for account in ([namespace] if namespace is not None else []) + list(tenants):
            left = self.usage.get(account, 0) - nbytes
            if left > 0:
                self.usage[account] = left
            else:
                self.usage.pop(account, None)
