"""Quota accounting: the bytes each namespace and each tenant account is charged, and the
room a write over a quota makes by evicting that account's own objects.

:class:`Accounts` keeps the charges against the ``[quotas]`` limits
(:class:`~kvbroker._server.policy.Quotas`): a namespace's, and with tenant quotas a user's
(``("user", uid)``) and a group's (``("group", gid)``). What is charged and when it is
uncharged follows the pages (an object's, a write arena's, quarantined pages' until their
writer is gone): the ownership contract in :mod:`kvbroker._server.state`.
It reads what may be evicted from the :class:`~kvbroker._server.directory.Directory` and
evicts through the broker (an eviction spans owners). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import QuotaExceeded
from .directory import Directory
from .policy import Quotas, user_name
from .state import Session, StoredObject

__all__ = ["AccountStatistics", "Accounts"]


@dataclass(frozen=True)
class AccountStatistics:
    """Bytes charged per namespace, and each namespace's quota (None: none)."""

    namespaces: dict[str, int]
    quotas: dict[str, int | None]
    tenants: dict[tuple[str, int], int]

    @property
    def charged(self) -> dict[Any, int]:
        """Every account charged (namespaces and tenants) -> bytes."""
        return {**self.namespaces, **self.tenants}


class Accounts:
    """Bytes charged per namespace and tenant account, against the quotas."""

    def __init__(
        self, quotas: Quotas, directory: Directory, evict: Callable[[StoredObject], None]
    ) -> None:
        self.quotas = quotas
        # namespace (or tenant account, ("user", uid) / ("group", gid)) -> bytes charged
        self.usage: dict[Any, int] = {}
        self._directory = directory  # what may be evicted, least recently used first
        self._evict = evict

    def tenants_of(self, session: Session) -> tuple[tuple[str, int], ...]:
        """The tenant accounts ``session``'s writes are charged to (none without tenant
        quotas)."""
        return self.quotas.tenants(session.uid, session.access.gids) if self.quotas else ()

    def charge(
        self,
        namespace: str | None,
        nbytes: int,
        enforce: bool = True,
        tenants: tuple[tuple[str, int], ...] = (),
    ) -> int:
        """Owns: ``nbytes`` charged to ``namespace`` and ``tenants``. Count ``nbytes`` against ``namespace`` (None: none) and each tenant account; over
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
        mine = [o for o in self._directory.evictable() if owned(o)]
        mine += [o for o in self._directory.retained() if owned(o)]  # a quota is hard
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
            self._directory.evicting(obj, "quota")
            self._evict(obj)

    def uncharge(
        self, namespace: Any, nbytes: int, tenants: tuple[tuple[str, int], ...] = ()
    ) -> None:
        """Frees: ``nbytes`` of the charges of ``namespace`` and ``tenants``."""
        for account in ([namespace] if namespace is not None else []) + list(tenants):
            left = self.usage.get(account, 0) - nbytes
            if left > 0:
                self.usage[account] = left
            else:
                self.usage.pop(account, None)

    def used(self, account: Any) -> int:
        """Bytes charged to ``account`` (a namespace, or ("user", uid) / ("group", gid))."""
        return self.usage.get(account, 0)

    def statistics(self, also: Iterable[str] = ()) -> AccountStatistics:
        """The charges; ``also``: namespaces to give the quota of though nothing is charged."""
        namespaces = {k: v for k, v in self.usage.items() if isinstance(k, str)}
        return AccountStatistics(
            namespaces=namespaces,
            quotas={ns: self.quotas.limit(ns) for ns in {*namespaces, *also}},
            tenants={k: v for k, v in self.usage.items() if isinstance(k, tuple)},
        )
