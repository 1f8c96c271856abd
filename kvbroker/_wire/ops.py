"""Typed op stubs: the only code asking the daemon that names an op of the wire protocol.

One method per row of :data:`kvbroker._wire.protocol.OPS`, taking that row's arguments
(same names, same defaults) and returning its reply, typed. Everything that talks to the
daemon goes through these: the blocking client (the :class:`~kvbroker.Client` facade,
leases, the write arena, :mod:`kvbroker.prefix`, :mod:`kvbroker.gpu`, the benchmarks),
reached as ``client.ops``, its session greeting through :meth:`Ops.hello`; and the TUI's
asyncio client (``kvbroker.tui._wire``), whose ``call`` returns an awaitable, so each stub
does too. They sit in the contract so that both can use them. Adding an op: a row in the
table, a handler in the daemon, one method here (``tests/test_client_ops.py`` checks that
the stubs and the table agree). See ``docs/design.md``.

Every stub sends all of its op's arguments, as given. Requests that name a lease
(:data:`LEASE_OPS`) are not resent after a reconnect: the lease went with the old connection.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import replies as R
from .protocol import LEASE_NAMING_OPS

__all__ = ["Ops", "LEASE_OPS"]

# Requests that name a lease of this connection (the table's lease column): after a
# reconnect they are not resent (the lease is gone), the client raises LeaseExpired instead.
LEASE_OPS = LEASE_NAMING_OPS


class Ops:
    """The daemon's operations as methods. ``call(op, args)`` sends a request (``args``: the
    op's arguments, one dict, built once here and sent as it is) and returns its reply
    (raising the error a failed reply names); ``send_only(op, args)`` sends one whose reply a
    later call reads and checks (see :meth:`Session.post`)."""

    __slots__ = ("_call", "_send", "_submit")

    def __init__(
        self,
        call: Callable[..., Any],
        send_only: Callable[..., None],
        submit: Callable[..., Any] | None = None,
    ) -> None:
        self._call = call
        self._send = send_only
        self._submit = submit

    @property
    def pipelined(self) -> Ops:
        """These stubs sending without waiting: each returns a
        :class:`~kvbroker._client.session.Pending` whose ``result()`` is the reply (typed as
        the stub says) or raises its error. The daemon answers a connection's requests in
        order; a caller keeps a batch in its queue and copies meanwhile."""
        if self._submit is None:
            raise TypeError("these stubs have no pipelined form (no session to submit to)")
        return Ops(self._submit, self._send)

    # -- session ---------------------------------------------------------------------------
    def hello(self, version: int, name: str = "", role: str = "") -> R.Hello:
        return self._call("hello", dict(version=version, name=name, role=role))

    # -- publish ---------------------------------------------------------------------------
    def reserve(
        self,
        key: str,
        buffers: Mapping[str, int],
        *,
        namespace: str = "default",
        meta: dict | None = None,
        replace: bool = False,
        ttl: float | None = None,
        consumers: int = 1,
        retain: dict | None = None,
    ) -> R.Reserved:
        """``retain``: ``{session, for?, priority?}`` (sent only when given: a daemon from
        before it refuses an argument it lacks)."""
        more = {} if retain is None else {"retain": retain}
        return self._call(
            "reserve",
            dict(
                namespace=namespace,
                key=key,
                buffers=dict(buffers),
                meta=meta,
                replace=replace,
                ttl=ttl,
                consumers=consumers,
                **more,
            ),
        )

    def seal(self, lease: int, checksums: dict[str, int] | None = None) -> R.Sealed:
        return self._call("seal", dict(lease=lease, checksums=checksums))

    def abort(self, lease: int) -> None:
        self._call("abort", dict(lease=lease))

    def abort_later(self, lease: int) -> None:
        """``abort``, its reply read by the next call (failure paths: saves a round trip)."""
        self._send("abort", dict(lease=lease))

    def arena(self, nbytes: int) -> R.ArenaLent:
        return self._call("arena", dict(nbytes=nbytes))

    def publish(
        self,
        arena: int,
        key: str,
        buffers: Mapping[str, int],
        *,
        namespace: str = "default",
        meta: dict | None = None,
        replace: bool = False,
        consumers: int = 1,
        checksums: dict[str, int] | None = None,
        next_arena: int = 0,
        retain: dict | None = None,
    ) -> R.Published:
        """``retain``: as in :meth:`reserve` (sent only when given)."""
        more = {} if retain is None else {"retain": retain}
        return self._call(
            "publish",
            dict(
                arena=arena,
                namespace=namespace,
                key=key,
                buffers=dict(buffers),
                meta=meta,
                replace=replace,
                consumers=consumers,
                checksums=checksums,
                next_arena=next_arena,
                **more,
            ),
        )

    # -- claim -----------------------------------------------------------------------------
    def claim(
        self,
        key: str,
        *,
        namespace: str = "default",
        select: str | None = None,
        consume: bool = False,
        wait: float | None = None,
        ttl: float | None = None,
        peer: str | None = None,
    ) -> R.Claimed:
        return self._call(
            "claim",
            dict(
                namespace=namespace,
                key=key,
                select=select,
                consume=consume,
                wait=wait,
                ttl=ttl,
                peer=peer,
            ),
        )

    def release(self, lease: int, consume: bool = True) -> None:
        self._call("release", dict(lease=lease, consume=consume))

    def release_later(self, lease: int) -> None:
        """``release``, pipelined: its reply is read and checked by the next call."""
        self._send("release", dict(lease=lease, consume=True))

    def renew(self, leases: list[int], ttl: float | None = None) -> R.Renewed:
        return self._call("renew", dict(leases=leases, ttl=ttl))

    # -- directory -------------------------------------------------------------------------
    def lookup(
        self, key: str, *, namespace: str = "default", peer: str | None = None
    ) -> dict | None:
        """An ObjectInfo dict (with checksums), or None."""
        return self._call("lookup", dict(namespace=namespace, key=key, peer=peer))

    def exists(self, key: str, *, namespace: str = "default") -> bool:
        """Whether the object is sealed (a read replica answers it where there is one)."""
        return self._call("exists", dict(namespace=namespace, key=key))

    def list(
        self,
        *,
        namespace: str | None = None,
        match: str | None = None,
        limit: int | None = None,
        after: int | None = None,
        tier: str = "all",
    ) -> R.Listed:
        """One page of objects; ``after``: the ``next`` of the previous page."""
        # `tier` only when not all: a daemon from before the disk tier refuses it
        more = {} if tier == "all" else {"tier": tier}
        return self._call(
            "list", dict(namespace=namespace, match=match, limit=limit, after=after, **more)
        )

    def evict(
        self,
        *,
        namespace: str | None = None,
        key: str | None = None,
        match: str | None = None,
        match_buffers: str | None = None,
        older_than: float | None = None,
        all: bool = False,
        dry_run: bool = False,
        tier: str = "all",
    ) -> R.Evicted:
        return self._call(
            "evict",
            dict(
                namespace=namespace,
                key=key,
                match=match,
                match_buffers=match_buffers,
                older_than=older_than,
                all=all,
                dry_run=dry_run,
                **({} if tier == "all" else {"tier": tier}),  # (as list's)
            ),
        )

    # -- prefix blocks ---------------------------------------------------------------------
    def reserve_blocks(
        self,
        blocks: list[dict[str, Any]],
        *,
        namespace: str = "default",
        ttl: float | None = None,
        buffers: dict[str, int] | None = None,
        meta: dict | None = None,
        compact: bool = False,
        retain: dict | None = None,
    ) -> R.BlocksReserved:
        """``blocks``: ``{key, parent: key | None, buffers: {name: nbytes}, meta?}`` each;
        ``buffers``/``meta``: for every block that has none of its own. ``retain``:
        ``{session, for?, priority?}`` (sent only when given)."""
        more = {} if retain is None else {"retain": retain}
        return self._call(
            "reserve_blocks",
            dict(
                namespace=namespace,
                blocks=blocks,
                ttl=ttl,
                buffers=buffers,
                meta=meta,
                compact=compact,
                **more,
            ),
        )

    def seal_many(
        self, leases: list[int], checksums: list[dict[str, int] | None] | None = None
    ) -> R.SealedMany:
        return self._call("seal_many", dict(leases=leases, checksums=checksums))

    def match_prefix(
        self,
        keys: list[str],
        *,
        namespace: str = "default",
        block_tokens: int = 0,
        ttl: float | None = None,
        peer: str | None = None,
        hold: bool = True,
        retain: dict | None = None,
    ) -> R.PrefixMatch:
        # `hold` only when false, `retain` only when given: a daemon from before them refuses
        # an argument it lacks.
        more: dict[str, Any] = {} if hold else {"hold": False}
        if retain is not None:
            more["retain"] = retain
        return self._call(
            "match_prefix",
            dict(
                namespace=namespace,
                keys=keys,
                block_tokens=block_tokens,
                ttl=ttl,
                peer=peer,
                **more,
            ),
        )

    def release_many(self, leases: list[int]) -> None:
        self._call("release_many", dict(leases=leases))

    # -- GPU staging rings -----------------------------------------------------------------
    def rings(self) -> R.Rings:
        return self._call("rings", {})

    def ring_reserve(
        self,
        device: int,
        nbytes: int,
        *,
        namespace: str = "default",
        key: str | None = None,
        meta: dict | None = None,
        ttl: float | None = None,
    ) -> R.RingRegion:
        return self._call(
            "ring_reserve",
            dict(device=device, nbytes=nbytes, namespace=namespace, key=key, meta=meta, ttl=ttl),
        )

    def ring_seal(self, lease: int) -> R.Sealed:
        return self._call("ring_seal", dict(lease=lease))

    def ring_claim(
        self,
        key: str,
        *,
        namespace: str = "default",
        consume: bool = True,
        wait: float | None = None,
    ) -> R.RingClaimed:
        return self._call(
            "ring_claim", dict(namespace=namespace, key=key, consume=consume, wait=wait)
        )

    def ring_lookup(self, keys: list[str], *, namespace: str = "default") -> R.RingFound:
        return self._call("ring_lookup", dict(namespace=namespace, keys=keys))

    def ring_release(self, lease: int) -> None:
        self._call("ring_release", dict(lease=lease))

    # -- peers ---------------------------------------------------------------------------
    def fetch(self, key: str, peer: str, *, namespace: str = "default") -> R.Fetched:
        return self._call("fetch", dict(namespace=namespace, key=key, peer=peer))

    # -- sessions ----------------------------------------------------------------------------
    def sessions(self, *, namespace: str | None = None, limit: int | None = None) -> R.Sessions:
        return self._call("sessions", dict(namespace=namespace, limit=limit))

    def retain(
        self,
        name: str,
        seconds: float,
        *,
        namespace: str | None = None,
        priority: int | None = None,
    ) -> dict:
        """A SessionInfo dict."""
        return self._call(
            "retain", dict(name=name, seconds=seconds, namespace=namespace, priority=priority)
        )

    def unretain(self, name: str, *, namespace: str | None = None) -> dict:
        """A SessionInfo dict (the session as it was)."""
        return self._call("unretain", dict(name=name, namespace=namespace))

    # -- statistics ------------------------------------------------------------------------
    def stat(self) -> dict:
        """A Statistics dict (:meth:`Statistics.from_dict`)."""
        return self._call("stat", {})

    def report(self, counters: dict[str, int]) -> R.Reported:
        return self._call("report", dict(counters=counters))

    def ping(self) -> R.Pong:
        return self._call("ping", {})

    def watch(self, interval: float = 1.0) -> R.Watching:
        """Subscribe to pushed snapshots (:meth:`Session.next_push`); 0 stops them."""
        return self._call("watch", dict(interval=interval))
