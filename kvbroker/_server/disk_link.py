"""How the disk tier reaches the pools: the broker's side of :mod:`~kvbroker._server.disk_tier`.

:class:`DiskLink` is what the tier may do to the pools, as narrow callables the daemon binds
at start (:func:`start`): hold an object as a reader while its copy is written and put it
back in the LRU after, reserve pages for a promotion (a write lease of the daemon's own
session, charged as the object was), seal what was promoted, and give back what was not. The
tier never sees the broker; the broker calls the tier through three hooks (an eviction
demotes, an unlink forgets, a seal replaces a disk copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest, KVBrokerError

__all__ = ["DiskLink", "open_pools", "start"]


@dataclass(eq=False)
class DiskLink:
    """The pools' side, as the disk tier uses it."""

    directory: Any  # kvbroker._server.directory.Directory: the LRU, pins
    free_object: Callable[[Any], None]  # an unlinked object's pages back to its pool
    reserve_extent: Callable[..., Any]  # Transitions.reserve_extent
    seal: Callable[[list], None]  # Transitions.seal_all
    live: Callable[[int], bool]  # a lease id not ended
    discard: Callable[[Any], None]  # an unsealed write lease's pages back, lease ended
    session: Any  # the daemon's session promotions reserve through
    ttl: float  # their write leases' (the longest a lease may live)

    def evictable(self) -> Any:
        """The pools' sealed, unleased objects, least recently used first."""
        return self.directory.evictable()

    def hold(self, obj: Any) -> None:
        """A reader while its copy is written to disk (not evicted, its pages not reused)."""
        self.directory.pin(obj, obj.last_access)

    def release(self, obj: Any, oldest: bool) -> None:
        """Its write to disk ended: back in the LRU, at its old end when ``oldest``."""
        gone = self.directory.unpin_oldest(obj) if oldest else self.directory.unpin(obj, False)
        if gone:  # unlinked meanwhile, and we were its last reader
            self.free_object(obj)

    def reserve(self, entry: Any) -> Any:
        """A write lease on fresh pages laid out as disk ``entry``'s object, charged as it
        was (its namespace, its writer's tenants), its fields as sealed."""
        if self.directory.taken(entry.ident):
            raise BadRequest(f"{entry.ident[0]}/{entry.ident[1]} is in a pool already")
        rec = entry.record
        layout = {name: (int(off), int(n)) for name, (off, n) in rec["buffers"].items()}
        ls = self.reserve_extent(
            self.session,
            entry.ident,
            layout,
            entry.length,
            rec.get("meta"),
            self.ttl,
            rec.get("tokens"),
            tenants=entry.tenants,
        )
        o = ls.obj
        o.checksums, o.parent_key = rec.get("checksums"), rec.get("parent_key")
        o.consumers, o.created_at = rec.get("consumers") or 1, rec.get("created_at") or 0
        return ls

    def give_back(self, ls: Any) -> None:
        if self.live(ls.id):  # (not ended meanwhile)
            self.discard(ls)


def start(cfg: Any, pools: list, quota_of: Callable[[Any], int | None]) -> Any:
    """The tier ``[tier.disk]`` configures, over ``pools`` (their segments opened here: the
    tier reads from them and writes into them), its index read back."""
    from .disk_store import DiskStore
    from .disk_tier import DiskTier

    store = DiskStore(
        list(cfg.tier_disk_directories),
        cfg.tier_disk_size,
        pools[0].page_size,
        direct=cfg.tier_disk_o_direct,
        threads=cfg.tier_disk_io_threads,
    )
    try:
        pages = open_pools(pools)
        try:
            tier = DiskTier(
                store,
                pages,
                policy=cfg.tier_disk_policy,
                writeback_watermark=cfg.tier_disk_writeback_watermark,
                writeback_inflight=cfg.tier_disk_writeback_inflight,
                quota_of=quota_of,
                quota_scale=store.capacity / max(1, sum(p.size for p in pools)),
            )
            tier.open()
        except BaseException:
            for p in pages:
                p.close()
            raise
    except BaseException:
        store.close()
        raise
    return tier


def open_pools(pools: list) -> list[Any]:
    """Each pool's pages, read and written through its segment's descriptor
    (:class:`~kvbroker._server.disk_store.PoolPages`), by pool index."""
    import posix_ipc

    from .disk_store import PoolPages
    from .pool import open_segment

    opened: list[Any] = []
    try:
        for pool in pools:
            try:
                shm = open_segment(pool.name)  # a tenant's pool too
            except (OSError, posix_ipc.Error) as exc:
                raise KVBrokerError(
                    f"[tier.disk] cannot open pool {pool.index} ({pool.name}): {exc}"
                ) from None
            opened.append(PoolPages(pool.index, shm.fd, pool.size))
    except BaseException:
        for p in opened:
            p.close()
        raise
    return opened
