"""Serving this daemon's sealed objects to peer brokers (issue 18): what a
:class:`~kvbroker._server.transfer.PeerServer` pins, describes and releases.

:class:`BrokerProvider` pins objects for peers through the broker's own lease machinery:
each authenticated peer connection is a broker session (named ``peer:<node>``); a pin is a
read lease of that session, bounded by the TTL the peer asked for (at most
``max_lease_ttl``), ended by the peer's release (a consume counts when the peer says so), by
its TTL, or when the connection closes — the broker's usual rules (the ownership contract in
:mod:`kvbroker._server.state`), so a peer's lease never outlives its connection. A pin
describes each object by its extents' addresses in this process, for the peer's NIXL READ.
The pulling side, and the daemon's fleet as a whole: :mod:`kvbroker._server.fleet`.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._wire.protocol import MAX_BUFFERS
from ..errors import BadRequest, Forbidden, LimitExceeded, NotFound, TransferFailed
from .checks import check_name
from .disk_store import PoolPages, PoolUnusable

if TYPE_CHECKING:
    from .broker import Broker
    from .state import Lease, Session, StoredObject

__all__ = ["BrokerProvider"]


def _names_a_tenant(glob: str) -> bool:
    """Whether ``glob`` may serve a tenant pool's namespace: its first path component (the
    tenant's part of a namespace) is literal, so no glob written for every namespace covers
    a tenant's by accident."""
    return not any(c in glob.split("/", 1)[0] for c in "*?[")


class BrokerProvider:
    """What a :class:`~kvbroker._server.transfer.PeerServer` serves: the broker's sealed
    objects, pinned by read leases of one session per peer connection."""

    def __init__(
        self,
        broker: Broker,
        bases: Sequence[int],
        serve: Sequence[tuple[str | None, str]] = ((None, "*"),),
        pages: Sequence[PoolPages] = (),
    ) -> None:
        self.broker = broker
        self.bases = list(bases)  # address of each pool in this process
        self.pages = list(pages)  # each pool's segment, to see that it was not truncated
        self.serve = tuple(serve)  # [transfer] serve: (peer host or None, namespace glob)
        self.sessions: dict[int, Session] = {}
        self.identities: dict[int, str] = {}  # connection -> the peer its certificate names
        self.pins_served = 0
        self.bytes_served = 0
        self.consumes_served = 0

    def peer_connected(self, peer: int, node: str, address: str, identity: str = "") -> None:
        s = self.broker.open_session(os.getpid(), os.getuid(), os.getgid())
        s.name, s.role, s.greeted = f"peer:{node}"[:512], "peer", True
        self.sessions[peer] = s
        self.identities[peer] = identity.lower()

    def _authorize(self, peer: int, namespace: str) -> None:
        """Forbidden unless ``[transfer] serve`` lets this peer pull ``namespace``: a glob
        for every peer or one for its host. A namespace held in a tenant's own pool is
        served only where a glob other than a bare ``*`` names it (that pool is mapped by
        its tenant alone here; serving it is the operator's explicit choice)."""
        who = self.identities.get(peer, "")
        tenant_pool = any(p.tenant is not None for p in self.broker.pages.pools_for(namespace))
        for host, glob in self.serve:
            if host is not None and host != who:
                continue
            if tenant_pool and not _names_a_tenant(glob):
                continue
            if fnmatch.fnmatchcase(namespace, glob):
                return
        raise Forbidden(
            f"namespace {namespace!r} is not served to peer {who or '?'}"
            f"{' (a tenant pool)' if tenant_pool else ''}: see [transfer] serve "
            "on that node"
        )

    def _check_lease_limit(self, peer: int, s: Session) -> None:
        """The broker's limits, and one client's budget for a peer in all: its sessions,
        the daemon's own pulls and its administrators' connections share one uid, so a
        peer pinning on many connections must not fill ``max_leases_per_uid``."""
        b = self.broker
        b.leases.check_limit(s)
        who = self.identities.get(peer, "")
        held = sum(
            len(x.leases) for p, x in self.sessions.items() if self.identities.get(p, "") == who
        )
        if held >= b.max_leases_per_client:
            raise LimitExceeded(
                f"peer {who or '?'} holds {held} leases on its connections "
                "together, the most one client may hold "
                "(max_leases_per_client): release some first"
            )

    def _session(self, peer: int) -> Session:
        s = self.sessions.get(peer)
        if s is None:  # a provider driven without the hook (tests): an anonymous peer
            self.peer_connected(peer, f"#{peer}", "?")
            s = self.sessions[peer]
        return s

    def _usable(self, objs: list[StoredObject]) -> list[StoredObject]:
        """The leading run of ``objs`` whose pools are whole; TransferFailed when the first
        one's is not. The peer's NIXL READ goes through this daemon's mapping: a pool a
        client truncated (a tenant may truncate its own) would be a SIGBUS here. Checked at
        the pin only: a truncation during the READ still is (docs/security.md)."""
        for i, obj in enumerate(objs):
            if obj.pool.index >= len(self.pages):
                continue
            try:
                self.pages[obj.pool.index].check()
            except PoolUnusable as exc:
                if i == 0:
                    raise TransferFailed(
                        f"{obj.namespace}/{obj.key} is not served: {exc}"
                    ) from None
                return objs[:i]
        return objs

    def _describe(self, obj: StoredObject) -> dict:
        base = self.bases[obj.pool.index]
        first = obj.start * obj.pool.page_size
        return {
            "namespace": obj.namespace,
            "key": obj.key,
            "nbytes": obj.nbytes,
            "buffers": {n: [off - first, size] for n, (off, size) in obj.buffers.items()},
            "extents": [[base + off, size] for off, size in obj.buffers.values() if size],
            "meta": obj.meta,
            "checksums": obj.checksums,
            "consumers": obj.consumers,
            "parent": obj.parent_key,
            "tokens": obj.tokens,
        }

    @property
    def max_lease_ttl(self) -> float:
        """The bound of the TTL rule the peer ops declare (kvbroker._wire.peer)."""
        return self.broker.max_lease_ttl

    def _ttl(self, ttl: float) -> float:
        # The local ops' check: a NaN would never be due in the expiry heap (issue 38).
        return self.broker.leases.ttl(ttl)

    def _names(self, namespace: str, keys: Sequence[str]) -> None:
        check_name("namespace", namespace)
        if len(keys) > MAX_BUFFERS:
            raise BadRequest(f"at most {MAX_BUFFERS} keys per request")
        for key in keys:
            if not isinstance(key, str):
                raise BadRequest("keys must be strings")
            check_name("key", key)

    def pin(self, peer: int, namespace: str, key: str, ttl: float, consume: bool) -> dict:
        b = self.broker
        self._names(namespace, (key,))
        ttl = self._ttl(ttl)
        self._authorize(peer, namespace)
        b.expire()
        s = self._session(peer)
        obj = b.objects.get((namespace, key))
        if obj is None:
            b.counters["misses"] += 1
            raise NotFound(f"{namespace}/{key} is not published on this broker")
        self._usable([obj])
        self._check_lease_limit(peer, s)
        b.directory.pin(obj)
        lease = b.leases.lend("read", s, obj, ttl, consume=consume)
        b.counters["claims"] += 1
        b.counters["hits"] += 1
        self.pins_served += 1
        return {"lease": lease.id, "ttl": ttl, "objects": [self._describe(obj)]}

    def pin_prefix(self, peer: int, namespace: str, keys: list[str], ttl: float) -> dict:
        b = self.broker
        self._names(namespace, keys)
        ttl = self._ttl(ttl)
        self._authorize(peer, namespace)
        b.expire()
        s = self._session(peer)
        found = []
        for key in keys:
            obj = b.objects.get((namespace, key))
            if obj is None:
                break
            found.append(obj)
        if not found:
            return {"lease": None, "ttl": 0.0, "objects": []}
        found = self._usable(found)
        self._check_lease_limit(peer, s)
        lease = b.match(s, found, ttl)[0]
        self.pins_served += 1
        return {"lease": lease.id, "ttl": ttl, "objects": [self._describe(o) for o in found]}

    def _lease(self, peer: int, lease: int) -> Lease:
        self.broker.expire()  # a TTL that passed ends the lease now, not at the next tick
        return self.broker.leases.of(self._session(peer), lease, "read")

    def release(self, peer: int, lease: int, consumed: bool) -> None:
        ls = self._lease(peer, lease)
        nbytes = sum(o.nbytes for o in ls.objects())
        consume = ls.consume and consumed
        self.broker.end_read(ls, "the peer released it", consume=consume)
        self.bytes_served += nbytes
        self.broker.counters["bytes_out"] += nbytes
        self.consumes_served += consume

    def renew(self, peer: int, lease: int, ttl: float) -> None:
        ttl = self._ttl(ttl)
        self.broker.leases.renew(self._lease(peer, lease), ttl)

    def lookup(self, peer: int, namespace: str, key: str) -> dict | None:
        self._names(namespace, (key,))
        self._authorize(peer, namespace)
        obj = self.broker.objects.get((namespace, key))
        if obj is None:
            return None
        info = self.broker.lookup(obj)  # its readers reported
        info["checksums"] = obj.checksums
        return info

    def drop_peer(self, peer: int) -> None:
        self.identities.pop(peer, None)
        s = self.sessions.pop(peer, None)
        if s is not None and s.id in self.broker.sessions:
            self.broker.close_session(s)

    @property
    def leases(self) -> int:
        return sum(len(s.leases) for s in self.sessions.values())
