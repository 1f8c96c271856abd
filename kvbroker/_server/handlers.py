"""One handler per op row the broker serves (``Service.BROKER`` in ``kvbroker._wire.protocol``).

``op_<name>(broker, session, **args)`` checks what the request asks (arguments already
validated against the table), makes the change through the broker's transitions
(:class:`~kvbroker._server.broker.Broker`) and returns the reply the table declares. Who
owns and frees what: see :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._version import __version__
from .._wire import checksum as _checksum
from .._wire import replies as R
from .._wire.names import check_buffer_name
from .._wire.objects import buffer_offsets
from .._wire.protocol import MAX_BUFFERS, MAX_NAME, MAX_REPORTED, PROTOCOL_VERSION, meta_problem
from ..errors import BadRequest, Exists, NotFound, PoolFull, ProtocolError
from . import prefix_leases
from .arenas import arena_of, end_arena, new_arena, publish_from_arena
from .evicting import MAX_LISTED_BYTES, evict, info_size
from .patterns import client_regex as _regex
from .prefix_leases import lazy_readers, lend_prefix, matched_run, materialize_holding
from .session_ops import op_retain, op_sessions, op_unretain, session_of_request  # noqa: F401
from .snapshot import statistics_for
from .state import (
    Deferred,
    Session,
    StoredObject,
    WouldWait,
    index_footprint,
    names_footprint,
    value_footprint,
)

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["HANDLERS"]

_MAX_LIST = 10_000
MAX_TOKENS = 1 << 16  # token ids of one prefix block


# ------------------------------------------------------------------------------ session
def op_hello(b: Broker, session: Session, version: int, name: str, role: str) -> R.Hello:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (daemon speaks {PROTOCOL_VERSION})"
        )
    session.name, session.role, session.greeted = name[:MAX_NAME], role[:MAX_NAME], True
    # Another tenant's pool keeps its index (extents name pools by index), not its segment.
    pools = [p.describe() if b.pages.named_to(p, session) else {"index": p.index, "hidden": True}
             for p in b.pools]
    return {
        "version": PROTOCOL_VERSION,
        "server_version": __version__,
        "server_pid": os.getpid(),
        "session": session.id,
        "lease_ttl": b.lease_ttl,
        "pools": pools,
        "epoch": b.epoch,
        "checksum_kinds": sorted(_checksum.KINDS),
        **({"replicas": list(b.replica_paths)} if b.replica_paths else {}),
    }


# ------------------------------------------------------------------------------ publish
def op_reserve(b: Broker, session, namespace, key, buffers, meta, replace, ttl,
               consumers) -> R.Reserved:  # fmt: skip
    if (problem := consumers_problem(consumers)) is not None:
        raise BadRequest(f"reserve: {problem}")
    ttl = _ttl(b, ttl)
    ident = (_check_name("namespace", namespace), _check_name("key", key))
    session.access.check(namespace, True, "reserve")
    layout, span = _buffer_layout(buffers, meta)
    _check_free(b, ident, replace)
    lease = b.reserve_extent(session, ident, layout, span, meta, ttl)
    lease.obj.consumers = consumers
    return {"lease": lease.id, "ttl": ttl, "buffers": _extents(lease.obj, lease.obj.buffers)}


def op_reserve_blocks(b: Broker, session, namespace, blocks, ttl, buffers=None, meta=None,
                      compact=False, retain=None) -> R.BlocksReserved:  # fmt: skip
    ttl = _ttl(b, ttl)
    _check_name("namespace", namespace)
    session.access.check(namespace, True, "reserve_blocks")
    if len(blocks) > MAX_BUFFERS:
        raise BadRequest(f"reserve_blocks: at most {MAX_BUFFERS} blocks per request")
    # Buffers and meta given once for the batch: laid out (and checked) once, not per block.
    shared = _buffer_layout(buffers, meta) if buffers is not None else None
    # What the blocks' index entries cost (index_footprint), the shared parts once.
    names_cost = names_footprint(shared[0]) if shared is not None else 0
    meta_cost = value_footprint(meta)
    plans = []
    for i, blk in enumerate(blocks):  # validate everything before reserving anything
        if not isinstance(blk, dict) or not isinstance(blk.get("key"), str):
            raise BadRequest(f"reserve_blocks: block {i} must be a map with a string key")
        parent = blk.get("parent")
        if (problem := parent_problem(parent)) is not None:
            raise BadRequest(f"reserve_blocks: block {i}: {problem}")
        bufs, own_meta = blk.get("buffers"), blk.get("meta", meta)
        if (bufs is None and shared is None) or (bufs is not None and not isinstance(bufs, dict)) \
                or (own_meta is not None and not isinstance(own_meta, dict)):  # fmt: skip
            raise BadRequest(f"reserve_blocks: block {i}: buffers (and meta) must be maps, "
                             "given per block or once for the batch")  # fmt: skip
        if bufs is not None:
            layout, span = _buffer_layout(bufs, own_meta)
            cost = names_footprint(layout)
        else:
            layout, span = shared  # type: ignore[misc]
            if own_meta is not meta and (problem := meta_problem(own_meta)) is not None:
                raise BadRequest(f"reserve_blocks: block {i}: {problem}")
            cost = names_cost
        cost += meta_cost if own_meta is meta else value_footprint(own_meta)
        ident = (namespace, _check_name("key", blk["key"]))
        tokens = blk.get("tokens")
        if (problem := tokens_problem(tokens)) is not None:
            raise BadRequest(f"reserve_blocks: block {i}: {problem}")
        cost += 36 * len(tokens or ())
        plans.append((ident, parent, layout, span, own_meta, tokens, cost))
    kept = session_of_request(b, session, namespace, retain, "reserve_blocks")
    results: list[R.BlockReserved | R.BlockExists] = []
    taken: list = []
    slots: list = []  # per block: its write lease, or None when it exists
    try:
        for ident, parent, layout, span, own_meta, tokens, cost in plans:
            if ident in b.objects or ident in b.pending:
                slots.append(None)
                continue
            lease = b.reserve_extent(session, ident, layout, span, own_meta, ttl, tokens, cost)
            lease.obj.parent_key = parent  # resolved at seal: it may be in this batch
            taken.append(lease)
            slots.append(lease)
    except BaseException:
        for lease in taken:  # all or nothing: a failed batch holds no pages
            b.discard_pending(lease, quarantine=False)
            b.end_lease(lease, "its batch failed")
        raise
    if kept is not None:  # the session's blocks: those here already now, the rest at seal
        b.retention.retain(kept, [b.objects[p[0]] for p, ls in zip(plans, slots)
                                  if ls is None and p[0] in b.objects])  # fmt: skip
        for lease in taken:
            b.retention.pending[lease.obj.serial] = kept
    if compact and taken:
        # One int64 row per reserved block, as a prefix match replies, when the blocks share
        # their buffer names: no per-buffer map to build, pack and parse.
        names = taken[0].obj.compact_extents()[0]
        rows = [ls.obj.compact_extents() for ls in taken]
        if all(shape == names for shape, _ in rows):
            return {"ttl": ttl, "results": [], "names": list(names),
                    "leases": [None if ls is None else ls.id for ls in slots],
                    "packed": b"".join(row for _, row in rows)}  # fmt: skip
    for ls in slots:
        if ls is None:
            results.append({"exists": True})
        else:
            results.append({"lease": ls.id, "buffers": _extents(ls.obj, ls.obj.buffers)})
    return {"ttl": ttl, "results": results}


def op_seal(b: Broker, session, lease, checksums=None) -> R.Sealed:
    ls = b.lease_of(session, lease, "write")
    _accept_checksums(b, ls.obj, checksums)
    return b.seal(ls)


def op_seal_many(b: Broker, session, leases, checksums) -> R.SealedMany:
    if checksums is not None and len(checksums) != len(leases):
        raise BadRequest("seal_many: checksums must have one entry (map or null) per lease")
    # All or nothing: every lease and checksum checked before the first seal.
    held = _batch(b, session, "seal_many", leases, "write")
    sums = [_checked_checksums(b, ls.obj, None if checksums is None else checksums[i])
            for i, ls in enumerate(held)]  # fmt: skip
    for ls, checked in zip(held, sums):
        ls.obj.checksums = checked
    b.seal_all(held)
    return {"sealed": len(leases)}


def op_arena(b: Broker, session, nbytes) -> R.ArenaLent:
    if nbytes <= 0:
        raise BadRequest("arena: nbytes must be positive")
    if session.arenas:  # one a connection: arenas are not evictable
        held = next(iter(session.arenas))
        raise BadRequest(f"arena: this connection already holds write arena {held}; "
                         "abort it first")  # fmt: skip
    arena = new_arena(b, session, nbytes)
    return {"lease": arena.id, "arena": arena.extent()}


def op_publish(b: Broker, session, arena, namespace, key, buffers, meta, replace, consumers,
               checksums, next_arena) -> R.Published:  # fmt: skip
    ar = arena_of(b, session, arena)
    if ar.pool.lost is not None:  # new clients could not map what is published there
        end_arena(b, ar, "its pool's shared memory is gone")
        raise PoolFull(f"publish: {ar.pool.lost} (restart the daemon)")
    if (problem := consumers_problem(consumers)) is not None:
        raise BadRequest(f"publish: {problem}")
    if next_arena < 0:
        raise BadRequest("publish: next_arena must be a size in bytes, or 0")
    ident = (_check_name("namespace", namespace), _check_name("key", key))
    session.access.check(namespace, True, "publish")
    if ar.pool not in b.pages.pools_for(namespace):  # another tenant's pool, or the shared ones
        raise PoolFull(f"publish: namespace {namespace!r} lives in another pool than arena "
                       f"{arena}'s; reserve instead")  # fmt: skip
    layout, span = _buffer_layout(buffers, meta)
    ps = ar.pool.page_size
    if span > ar.npages * ps:
        raise BadRequest(f"publish: {span} bytes do not fit arena {arena} "
                         f"({ar.npages * ps} bytes); reserve instead")  # fmt: skip
    # An object occupies the daemon memory of its index entry at least (reserve_extent).
    npages = max(1, -(-max(span, index_footprint(layout, meta)) // ps))
    if npages > ar.npages:  # the client falls back to reserve + seal
        raise PoolFull(f"publish: names and meta take more than arena {arena}; reserve instead")
    _check_free(b, ident, replace)
    obj = b.new_object(ident, ar.pool, ar.start, npages, layout, meta)
    _accept_checksums(b, obj, checksums)
    obj.consumers = consumers
    obj.charged = b.accounts.charge(ident[0], npages * ps)
    sealed, ar = publish_from_arena(b, session, ar, obj, next_arena)
    return {**sealed, "lease": None if ar is None else ar.id,
            "arena": None if ar is None else ar.extent()}  # fmt: skip


def op_abort(b: Broker, session, lease) -> R.Empty:
    if lease in b.arenas:
        end_arena(b, arena_of(b, session, lease), "it was aborted")
        return {}
    ls = b.lease_of(session, lease, "write")
    b.discard_pending(ls, quarantine=False)
    b.end_lease(ls, "it was aborted")
    b.counters["aborts"] += 1
    return {}


# ------------------------------------------------------------------------------ claim
def op_claim(b: Broker, session, namespace, key, select, consume, wait, ttl,
             peer=None) -> R.Claimed:  # fmt: skip
    # A consume-claim frees the object when released: as much a write as evict is.
    session.access.check(namespace, bool(consume), "consume-claim" if consume else "claim")
    ident = (namespace, key)
    obj = b.objects.get(ident)
    if obj is None and peer is not None:  # pull it from the peer, then claim it here
        session.access.check(namespace, True, "claim from a peer")  # it writes our pools
        fleet = _fleet(b, "claim")
        raise Deferred(lambda: fleet.fetch(peer, namespace, key, consume, session),
                       lambda _: op_claim(b, session, namespace, key, select, consume, None,
                                          ttl),
                       fleet.timeout)  # fmt: skip
    if obj is None:
        if wait is not None and wait > 0:
            raise WouldWait(ident, float(wait))
        b.counters["misses"] += 1
        raise NotFound(f"{namespace}/{key} is not published")
    if select is None:
        chosen = obj.buffers
    else:
        pattern = _regex(select)
        chosen = {n: e for n, e in obj.buffers.items() if pattern.fullmatch(n)}
    ttl = _ttl(b, ttl)
    b.check_lease_limit(session)
    b.pin(obj)
    lease = b.new_lease("read", session, obj, ttl, consume=consume)
    nbytes = sum(n for _, n in chosen.values())
    c = b.counters
    c["claims"] += 1
    c["hits"] += 1
    c["bytes_out"] += nbytes
    session.bytes_claimed += nbytes
    b.record_transfer("claim", session, obj, nbytes)
    sums = obj.checksums
    return {
        "lease": lease.id,
        "ttl": ttl,
        "meta": obj.meta,
        "buffers": _extents(obj, chosen),
        "checksums": None if sums is None else {n: sums[n] for n in chosen},
    }


def op_release(b: Broker, session, lease, consume=True) -> R.Empty:
    ls = b.lease_of(session, lease, "read")
    b.end_read(ls, "it was released", consume=ls.consume and consume)
    return {}


def op_release_many(b: Broker, session, leases) -> R.Empty:
    for ls in _batch(b, session, "release_many", leases, "read"):  # all checked first
        b.end_read(ls, "it was released", consume=ls.consume)
    return {}


def op_match_prefix(b: Broker, session, namespace, keys, block_tokens, ttl,
                    peer=None, hold=True, retain=None) -> R.PrefixMatch:  # fmt: skip
    ttl = _ttl(b, ttl)
    if len(keys) > MAX_BUFFERS:
        raise BadRequest(f"match_prefix: at most {MAX_BUFFERS} keys per request")
    if not 0 <= block_tokens <= MAX_TOKENS:  # it is added into counters every stat packs
        raise BadRequest(f"match_prefix: block_tokens must be in [0, {MAX_TOKENS}]")
    if peer is not None and not hold:
        raise BadRequest("match_prefix: a pull from a peer needs hold (it holds what it pulls)")
    if not session.access.can(namespace):  # another tenant's prefixes: invisible
        keys = ()
    found = matched_run(b, namespace, keys)
    if peer is not None and len(found) < len(keys):
        # Pull the blocks after the local run that the peer holds, then match here.
        session.access.check(namespace, True, "match_prefix from a peer")
        rest = keys[len(found):]
        if all(k.__class__ is str for k in rest):
            fleet = _fleet(b, "match_prefix")
            raise Deferred(lambda: fleet.fetch_prefix(peer, namespace, list(rest), session),
                           lambda _: op_match_prefix(b, session, namespace, keys,
                                                     block_tokens, ttl, retain=retain),
                           fleet.timeout)  # fmt: skip
    prefix_leases.count_query(b, len(keys), len(found), block_tokens)
    kept = session_of_request(b, session, namespace, retain, "match_prefix")
    if kept is not None:  # each request renews its session; what it matched is retained
        b.retention.retain(kept, found)
    if not found or not hold:
        prefix_leases.keep_recent(b, found)
        return {"ttl": ttl, "matched": len(found), "lease": None, "names": [], "blocks": []}
    b.check_lease_limit(session)
    lease, names, packed, nbytes = lend_prefix(b, session, found, ttl)
    b.counters["bytes_out"] += nbytes
    session.bytes_claimed += nbytes
    reply: R.PrefixMatch = {"ttl": ttl, "matched": len(found), "lease": lease.id,
                            "names": list(names), "metas": [found[0].meta], "blocks": []}
    # Compact reply: when every block has the same buffer names (the usual case), one bytes
    # string `packed` of little-endian int64 rows, a row per block; else a map per block.
    if packed is not None:
        reply["packed"] = packed
    else:
        reply["blocks"] = [_extents(obj, obj.buffers) for obj in found]
    return reply


def op_renew(b: Broker, session, leases, ttl) -> R.Renewed:
    ttl = _ttl(b, ttl) if ttl is not None else None
    held = _batch(b, session, "renew", leases, None, repeats=True)  # all checked first
    for ls in {ls.id: ls for ls in held}.values():  # a lease named twice is renewed once
        b.renew(ls, ls.ttl if ttl is None else ttl)
    return {"expires_in": [(ls.id, ls.ttl) for ls in held]}


def _batch(b: Broker, session, op: str, lids: list, kind: str | None,
           repeats: bool = False) -> list:  # fmt: skip
    """The live leases ``lids`` of this session (of ``kind``), every one checked before a
    batch op acts on any: a bad id fails the request and changes nothing."""
    held = []
    for lid in lids:
        if not isinstance(lid, int) or isinstance(lid, bool):
            raise BadRequest(f"{op}: leases must be a list of lease ids")
        held.append(b.lease_of(session, lid, kind))
    if not repeats and len({ls.id for ls in held}) != len(held):
        raise BadRequest(f"{op}: a lease is named twice")
    return held


# ------------------------------------------------------------------------------ directory
def op_lookup(b: Broker, session, namespace, key, peer=None) -> dict | None:
    obj = b.objects.get((namespace, key))
    if obj is None and peer is not None and session.access.can(namespace):
        fleet = _fleet(b, "lookup")
        raise Deferred(lambda: fleet.lookup(peer, namespace, key), lambda info: info,
                       fleet.timeout)  # fmt: skip
    if obj is None or not session.access.can(namespace):
        return None
    materialize_holding(b, obj)  # its readers reported
    info = obj.info()
    info["checksums"] = obj.checksums
    info["buffer_sizes"] = {name: n for name, (_, n) in obj.buffers.items()}
    info["consumers"] = obj.consumers
    return info


def op_exists(b: Broker, session, namespace, key) -> bool:
    return (namespace, key) in b.objects and session.access.can(namespace)


def op_list(b: Broker, session, namespace, match, limit, after) -> R.Listed:
    limit = _MAX_LIST if limit is None else max(0, min(limit, _MAX_LIST))
    pattern = _regex(match) if match is not None else None
    out, last, truncated = [], None, False
    can = session.access.can
    if namespace is not None and not can(namespace):
        return {"objects": [], "truncated": False, "next": None}
    lazy = lazy_readers(b) if b.lazy_leases else None  # readers reported, nothing changed
    # Objects iterate in link order (StoredObject.seq rises along it): a page resumes after
    # the last object the previous one listed, whatever was sealed or freed since.
    objects = iter(b.in_namespace(namespace))
    if after is not None:
        objects = (o for o in objects if o.seq > after)
    size = 0
    for obj in objects:
        if namespace is None and not can(obj.namespace):
            continue
        if pattern is not None and not pattern.search(obj.key):
            continue
        size += info_size(obj)
        if len(out) == limit or (out and size > MAX_LISTED_BYTES):
            truncated = True
            break
        out.append(info := obj.info())
        if lazy:
            info["readers"] += lazy[obj]
        last = obj.seq
    return {"objects": out, "truncated": truncated,
            "next": (last if last is not None else after or 0) if truncated else None}


def op_evict(b: Broker, session, namespace, key, match, match_buffers, older_than, all,
             dry_run) -> R.Evicted:  # fmt: skip
    return evict(b, session, namespace, key, match, match_buffers, older_than, all, dry_run)


def op_fetch(b: Broker, session, namespace, key, peer) -> R.Fetched:
    session.access.check(namespace, True, "fetch")
    obj = b.objects.get((namespace, key))
    if obj is not None:  # here already: never fetched twice
        return {"namespace": namespace, "key": key, "nbytes": obj.nbytes, "fetched": False,
                "peer": peer}  # fmt: skip
    fleet = _fleet(b, "fetch")
    return _defer_fetch(b, session, fleet, namespace, key, peer)


def _defer_fetch(b: Broker, session, fleet: Any, namespace: str, key: str, peer: str):
    def then(pulled: bool) -> R.Fetched:
        obj = b.objects.get((namespace, key))
        if obj is None:
            raise NotFound(f"{namespace}/{key} was pulled from {peer} but is gone again "
                           "(consumed or evicted)")  # fmt: skip
        return {"namespace": namespace, "key": key, "nbytes": obj.nbytes,
                "fetched": bool(pulled), "peer": peer}  # fmt: skip

    raise Deferred(lambda: fleet.fetch(peer, namespace, key, False, session), then,
                   fleet.timeout)


def op_stat(b: Broker, session) -> dict[str, Any]:
    return statistics_for(b, session).to_dict()


def op_ping(b: Broker, session) -> R.Pong:
    return {"server_version": __version__, "server_pid": os.getpid(),
            "started_at": b.started_at, "epoch": b.epoch}


def op_report(b: Broker, session, counters) -> R.Reported:
    if len(counters) > MAX_REPORTED:
        raise BadRequest(f"report: at most {MAX_REPORTED} counters")
    for name, value in counters.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
            raise BadRequest("report: counter names must be printable strings of 1-64 characters")
        if value.__class__ is not int or not 0 <= value < 1 << 63:
            raise BadRequest(f"report: counter {name!r} must be a non-negative int")
    session.reported = dict(counters)
    return {"counters": len(counters)}


HANDLERS = {name[3:]: fn for name, fn in list(globals().items()) if name.startswith("op_")}


# ------------------------------------------------------------------------------ checks
def _fleet(b: Broker, op: str) -> Any:
    if b.fleet is None:
        raise BadRequest(f"{op} with a peer: this daemon pulls from no peer (set [transfer] "
                         "peers, cert_file, key_file and ca_file, and install "
                         "kvbroker[transfer])")  # fmt: skip
    return b.fleet


def _ttl(b: Broker, ttl: float | None) -> float:
    """A lease TTL asked for (in range: the op table's rule checked it), or the default."""
    return b.lease_ttl if ttl is None else float(ttl)


def _accept_checksums(b: Broker, obj: StoredObject, checksums: dict | None) -> None:
    checked = _checked_checksums(b, obj, checksums)
    if checked is not None:
        obj.checksums = checked


def _checked_checksums(b: Broker, obj: StoredObject, checksums: dict | None) -> dict | None:
    """``checksums`` as ``obj`` keeps them; BadRequest when they do not fit its buffers, or
    are missing where the daemon requires them."""
    if checksums is not None:
        try:
            return _checksum.validate(checksums, obj.buffers)
        except ValueError as exc:
            raise BadRequest(f"seal of {obj.namespace}/{obj.key}: {exc}") from None
    if b.require_checksums:
        raise BadRequest(
            f"seal of {obj.namespace}/{obj.key}: this daemon requires a checksum per "
            "buffer (require_checksums); seal with checksums"
        )
    return None


def _check_free(b: Broker, ident: tuple[str, str], replace: bool) -> None:
    namespace, key = ident
    if ident in b.pending:
        raise Exists(f"{namespace}/{key} is being published by another writer")
    if ident in b.objects and not replace:
        raise Exists(f"{namespace}/{key} is already published")


def _buffer_layout(buffers: dict, meta: dict | None) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of the named buffers inside one extent (aligned), and the extent's span."""
    if not buffers:
        raise BadRequest("reserve: an object needs at least one buffer")
    if len(buffers) > MAX_BUFFERS:
        raise BadRequest(f"reserve: at most {MAX_BUFFERS} buffers per object")
    problem = meta_problem(meta)
    if problem is not None:
        raise BadRequest(f"reserve: {problem}")
    for name, nbytes in buffers.items():
        if not isinstance(name, str):
            raise BadRequest("reserve: buffer names must be strings")
        _check_name("buffer name", name)
        check_buffer_name(name)  # malformed KV names would never match a claim
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise BadRequest(f"reserve: size of buffer {name!r} must be a non-negative int")
    offsets, span = buffer_offsets(buffers)
    return {name: (offsets[name], nbytes) for name, nbytes in buffers.items()}, span


def consumers_problem(consumers: Any) -> str | None:
    """Why ``consumers`` cannot be an object's consumer count (a seal here or a pull)."""
    if consumers.__class__ is not int or not 1 <= consumers <= 1 << 16:
        return "consumers must be between 1 and 65536"
    return None


def tokens_problem(tokens: Any) -> str | None:
    """Why ``tokens`` cannot be a prefix block's token ids (the events announce them)."""
    if tokens is not None and not (
            isinstance(tokens, list) and len(tokens) <= MAX_TOKENS
            and all(t.__class__ is int for t in tokens)):  # fmt: skip
        return f"tokens must be a list of at most {MAX_TOKENS} token ids"
    return None


def parent_problem(parent: Any) -> str | None:
    """Why ``parent`` cannot name a prefix block's parent (a key, or null)."""
    if parent is None:
        return None
    if not isinstance(parent, str) or not 0 < len(parent) <= MAX_NAME:
        return f"parent must be a key (1 to {MAX_NAME} characters) or null"
    return None


def _check_name(what: str, value: str) -> str:
    if not value:
        raise BadRequest(f"{what} must not be empty")
    if len(value) > MAX_NAME:
        raise BadRequest(f"{what} longer than {MAX_NAME} characters")
    return value


def _extents(obj: StoredObject, chosen: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    idx = obj.pool.index
    return {name: [idx, off, n] for name, (off, n) in chosen.items()}
