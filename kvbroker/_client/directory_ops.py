"""The client's directory requests: whether objects exist, their listing and eviction, a
peer's objects fetched, the daemon's liveness and lease renewal (a part of :class:`Client`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from .leases import _Lease
from .mappings import process_maps as _process_maps  # noqa: F401  (tests count its holders)
from .._wire.stats import ObjectInfo
from ..errors import BadRequest


# Seconds added to the reply timeout of a call that pulls from a peer broker: the daemon
# bounds the pull itself ([transfer] timeout, 60 s by default) and answers Timeout.
PEER_GRACE = 120.0


class EvictResult:
    """What ``evict`` freed (or, with ``dry_run``, would free)."""

    def __init__(self, reply: dict) -> None:
        self.objects = [ObjectInfo.from_dict(o) for o in reply["evicted"]]
        self.count: int = reply["count"]
        self.bytes: int = reply["bytes"]
        self.skipped_leased: int = reply["skipped_leased"]
        self.dry_run: bool = reply["dry_run"]
        self.on_disk: int = reply.get("on_disk", 0)  # disk copies dropped ([tier.disk])

    def __repr__(self) -> str:
        verb = "would evict" if self.dry_run else "evicted"
        return f"<EvictResult {verb} {self.count} objects, {self.bytes} bytes>"


class Listing(list):
    """The objects :meth:`Client.list` found (a list of ObjectInfo); ``truncated``: more
    objects matched than it holds (its ``limit`` was reached)."""

    truncated: bool = False


class DirectoryOps:
    """What a :class:`Client` asks of the daemon's directory."""

    # -- directory -------------------------------------------------------------------------
    def exists(self, key: str, *, namespace: str = "default", peer: str | None = None) -> bool:
        """Whether the object is sealed here (or, with ``peer``, here or on that broker;
        nothing is pulled)."""
        if peer is None and self._replica is not None:  # (_call picks replica or daemon)
            return self.ops.exists(key, namespace=namespace)
        return (
            self._peer_call(peer is not None, self.ops.lookup, key, namespace=namespace, peer=peer)
            is not None
        )

    def lookup(
        self, key: str, *, namespace: str = "default", peer: str | None = None
    ) -> ObjectInfo | None:
        info = self._peer_call(
            peer is not None, self.ops.lookup, key, namespace=namespace, peer=peer
        )
        return None if info is None else ObjectInfo.from_dict(info)

    def fetch(self, key: str, peer: str, *, namespace: str = "default") -> dict:
        """Pull ``key`` from the broker at ``peer`` (HOST:PORT) into this node's pools,
        unless it is here already; no lease is held afterwards. Returns ``{namespace, key,
        nbytes, fetched, peer}`` (``fetched`` False: it was here)."""
        return self._peer_call(peer is not None, self.ops.fetch, key, peer, namespace=namespace)

    def _peer_call(self, pulls: bool, fn, *args, **kw):
        """``fn(*args, **kw)``, with a longer reply timeout when the daemon may pull first."""
        if not pulls or self._timeout is None:
            return fn(*args, **kw)
        self._session.settimeout(self._timeout + PEER_GRACE)
        try:
            return fn(*args, **kw)
        finally:
            self._session.settimeout(self._timeout)

    def list(
        self,
        match: str | None = None,
        *,
        namespace: str | None = None,
        limit: int | None = None,
        tier: str = "all",
    ) -> Listing:
        """Sealed objects (a regex ``match`` over keys, one ``namespace``), in the order they
        were sealed: all of them, or at most ``limit``. The list's ``truncated`` says
        whether more matched than it holds (only ever with a ``limit``). Each object's
        ``tier`` says where it is: dram (a pool), disk (the disk tier only) or dram+disk;
        ``tier`` lists all of them, those in a pool (dram) or those with a copy on disk
        (disk), as ``evict``'s ``tier`` picks them."""
        out = Listing()
        for page in self.list_pages(match, namespace=namespace, limit=limit, tier=tier):
            out.extend(page)
            out.truncated = page.truncated
        return out

    def list_pages(
        self,
        match: str | None = None,
        *,
        namespace: str | None = None,
        limit: int | None = None,
        page_size: int | None = None,
        tier: str = "all",
    ) -> Iterator[Listing]:
        """:meth:`list` one reply at a time (the daemon sends at most 10,000 objects, and
        about 4 MiB of them, a reply, or ``page_size``): each page a :class:`Listing`, the
        last one's ``truncated`` as
        :meth:`list`'s. An object sealed again while the pages are read may be listed twice
        (its old and its new version); every other object there from start to end, once."""
        if page_size is not None and page_size < 1:
            raise BadRequest(f"list_pages: page_size must be 1 or more, not {page_size}")
        after = None
        left = limit
        while True:
            ask = page_size if left is None else min(left, page_size or left)
            reply = self.ops.list(
                namespace=namespace, match=match, limit=ask, after=after, tier=tier
            )
            page = Listing(ObjectInfo.from_dict(o) for o in reply["objects"])
            page.truncated = bool(reply["truncated"])
            if left is not None:
                left -= len(page)
            yield page
            if not page.truncated or left == 0:
                return
            after = reply["next"]

    def evict(
        self,
        key: str | None = None,
        *,
        match: str | None = None,
        namespace: str | None = None,
        match_buffers: str | None = None,
        older_than: float | None = None,
        all: bool = False,
        dry_run: bool = False,
        tier: str = "all",
    ) -> EvictResult:
        """Free sealed objects matching every filter given; leased ones are skipped.

        With ``key`` and no ``namespace``, the key is evicted from every namespace. ``tier``
        (a disk tier's daemon): all, dram (kept on disk) or disk (the disk copies only)."""
        return EvictResult(
            self.ops.evict(
                key=key,
                match=match,
                namespace=namespace,
                match_buffers=match_buffers,
                older_than=older_than,
                all=all,
                dry_run=dry_run,
                tier=tier,
            )
        )

    def ping(self) -> float:
        """Seconds one round trip to the daemon takes (an op that does nothing)."""
        t0 = time.perf_counter()
        self.ops.ping()
        return time.perf_counter() - t0

    def renew(self, *leases: _Lease, ttl: float | None = None) -> None:
        self.ops.renew([ls.id for ls in leases], ttl)
