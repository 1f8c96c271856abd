"""The handlers of the publishing ops: ``reserve``, ``reserve_blocks``, ``seal``,
``seal_many``, ``arena``, ``publish``, ``abort``.

:class:`PublishOps` holds them; as every handler (:mod:`kvbroker._server.handlers`), each
checks what the request asks, makes one transition of the broker's
(:class:`~kvbroker._server.transitions.Transitions`) and shapes the reply. Who owns and frees
what: see :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

from .disk_tier import on_disk_only
from .._wire import replies as R
from ..errors import BadRequest, Exists, PoolFull
from .checks import (
    block_plans,
    buffer_layout,
    check_name,
    checked_checksums,
    consumers_problem,
    extents,
    leases_named,
)
from .retention import Retained
from .session_ops import SessionOps
from .state import StoredObject, index_footprint
from .transitions import Transitions

__all__ = ["PublishOps"]


class PublishOps:
    """The publishing ops' handlers, over the broker's transitions."""

    def __init__(self, broker: Transitions, sessions: SessionOps) -> None:
        self.b = broker
        self.sessions = sessions

    # -------------------------------------------------------------------------- publish
    def op_reserve(
        self, session, namespace, key, buffers, meta, replace, ttl, consumers, retain=None
    ) -> R.Reserved:
        if (problem := consumers_problem(consumers)) is not None:
            raise BadRequest(f"reserve: {problem}")
        ttl = self.b.leases.ttl(ttl)
        ident = (check_name("namespace", namespace), check_name("key", key))
        session.access.check(namespace, True, "reserve")
        layout, span = buffer_layout(buffers, meta)
        kept = self.sessions.session_of_request(session, namespace, retain, "reserve")
        self._check_free(ident, replace, kept)
        lease = self.b.reserve_extent(session, ident, layout, span, meta, ttl)
        lease.obj.consumers = consumers
        if kept is not None:  # retained once sealed (Directory.link)
            self.b.retention.pending[lease.obj.serial] = kept
        return {
            "lease": lease.id,
            "ttl": ttl,
            "buffers": extents(lease.obj, lease.obj.buffers),
        }

    def op_reserve_blocks(
        self,
        session,
        namespace,
        blocks,
        ttl,
        buffers=None,
        meta=None,
        compact=False,
        retain=None,
    ) -> R.BlocksReserved:
        b = self.b
        ttl = b.leases.ttl(ttl)
        check_name("namespace", namespace)
        session.access.check(namespace, True, "reserve_blocks")
        plans = block_plans(namespace, blocks, buffers, meta)
        kept = self.sessions.session_of_request(session, namespace, retain, "reserve_blocks")
        slots = b.reserve_all(session, plans, ttl)
        taken = [ls for ls in slots if ls is not None]
        if kept is not None:  # the session's blocks: those here already now, the rest at seal
            here = [b.directory.get(p[0]) for p, ls in zip(plans, slots, strict=True) if ls is None]
            b.retention.retain(kept, [o for o in here if o is not None])
            for lease in taken:
                b.retention.pending[lease.obj.serial] = kept
        if compact and taken:
            # One int64 row per reserved block, as a prefix match replies, when the blocks
            # share their buffer names: no per-buffer map to build, pack and parse.
            names = taken[0].obj.compact_extents()[0]
            rows = [ls.obj.compact_extents() for ls in taken]
            if all(shape == names for shape, _ in rows):
                return {
                    "ttl": ttl,
                    "results": [],
                    "names": list(names),
                    "leases": [None if ls is None else ls.id for ls in slots],
                    "packed": b"".join(row for _, row in rows),
                }
        results: list[R.BlockReserved | R.BlockExists] = [
            {"exists": True}
            if ls is None
            else {"lease": ls.id, "buffers": extents(ls.obj, ls.obj.buffers)}
            for ls in slots
        ]
        return {"ttl": ttl, "results": results}

    def op_seal(self, session, lease, checksums=None) -> R.Sealed:
        ls = self.b.leases.of(session, lease, "write")
        self._accept_checksums(ls.obj, checksums)
        return self.b.seal(ls)

    def op_seal_many(self, session, leases, checksums) -> R.SealedMany:
        if checksums is not None and len(checksums) != len(leases):
            raise BadRequest("seal_many: checksums must have one entry (map or null) per lease")
        # All or nothing: every lease and checksum checked before the first seal.
        held = leases_named(self.b.leases, session, "seal_many", leases, "write")
        required = self.b.require_checksums
        sums = [
            checked_checksums(ls.obj, None if checksums is None else checksums[i], required)
            for i, ls in enumerate(held)
        ]
        for ls, checked in zip(held, sums, strict=True):
            ls.obj.checksums = checked
        self.b.seal_all(held)
        return {"sealed": len(leases)}

    def op_arena(self, session, nbytes) -> R.ArenaLent:
        if nbytes <= 0:
            raise BadRequest("arena: nbytes must be positive")
        if session.arenas:  # one a connection: arenas are not evictable
            held = next(iter(session.arenas))
            raise BadRequest(
                f"arena: this connection already holds write arena {held}; abort it first"
            )
        arena = self.b.arenas.lend(session, nbytes)
        return {"lease": arena.id, "arena": arena.extent()}

    def op_publish(
        self,
        session,
        arena,
        namespace,
        key,
        buffers,
        meta,
        replace,
        consumers,
        checksums,
        next_arena,
        retain=None,
    ) -> R.Published:
        b = self.b
        ar = b.arenas.of(session, arena)
        if ar.pool.lost is not None:  # new clients could not map what is published there
            b.arenas.end(ar, "its pool's shared memory is gone")
            raise PoolFull(f"publish: {ar.pool.lost} (restart the daemon)")
        if (problem := consumers_problem(consumers)) is not None:
            raise BadRequest(f"publish: {problem}")
        if next_arena < 0:
            raise BadRequest("publish: next_arena must be a size in bytes, or 0")
        ident = (check_name("namespace", namespace), check_name("key", key))
        session.access.check(namespace, True, "publish")
        if ar.pool not in b.pages.pools_for(namespace):  # another tenant's or the shared ones
            raise PoolFull(
                f"publish: namespace {namespace!r} lives in another pool than arena "
                f"{arena}'s; reserve instead"
            )
        layout, span = buffer_layout(buffers, meta)
        ps = ar.pool.page_size
        if span > ar.npages * ps:
            raise BadRequest(
                f"publish: {span} bytes do not fit arena {arena} "
                f"({ar.npages * ps} bytes); reserve instead"
            )
        # An object occupies the daemon memory of its index entry at least (reserve_extent).
        npages = max(1, -(-max(span, index_footprint(layout, meta)) // ps))
        if npages > ar.npages:  # the client falls back to reserve + seal
            raise PoolFull(f"publish: names and meta take more than arena {arena}; reserve instead")
        retained = self.sessions.session_of_request(session, namespace, retain, "publish")
        self._check_free(ident, replace, retained)
        obj = b.directory.new_object(ident, ar.pool, ar.start, npages, layout, meta)
        self._accept_checksums(obj, checksums)
        obj.consumers = consumers
        obj.charged = b.accounts.charge(ident[0], npages * ps)
        if retained is not None:  # retained as it is sealed (Directory.link)
            b.retention.pending[obj.serial] = retained
        try:
            sealed, kept = b.publish(session, ar, obj, next_arena)
        finally:
            b.retention.pending.pop(obj.serial, None)  # sealed, or never to be
        return {
            **sealed,
            "lease": None if kept is None else kept.id,
            "arena": None if kept is None else kept.extent(),
        }

    def op_abort(self, session, lease) -> R.Empty:
        b = self.b
        if lease in b.arenas:
            b.arenas.end(b.arenas.of(session, lease), "it was aborted")
            return {}
        b.abort(b.leases.of(session, lease, "write"), "it was aborted")
        b.counters["aborts"] += 1
        return {}

    def _accept_checksums(self, obj: StoredObject, checksums: dict | None) -> None:
        checked = checked_checksums(obj, checksums, self.b.require_checksums)
        if checked is not None:
            obj.checksums = checked

    def _check_free(self, ident: tuple[str, str], replace: bool, kept: Retained | None) -> None:
        """Exists unless ``ident`` may be published; a session the request names (``kept``)
        retains the object already published there, as it would have retained this one."""
        namespace, key = ident
        if ident in self.b.directory.pending:
            raise Exists(f"{namespace}/{key} is being published by another writer")
        if not replace and (ident in self.b.directory or on_disk_only(self.b.pages.tier, ident)):
            there = self.b.directory.get(ident)
            if kept is not None and there is not None:
                self.b.retention.retain(kept, (there,))
            raise Exists(f"{namespace}/{key} is already published")
