"""Warm restart: what of a previous daemon's journal (:mod:`kvbroker._server.journal`) a new
broker adopts (:func:`plan`; the broker then adopts it: ``Broker.restore``).

A sealed object survives a daemon's death as a journal record; the pages it had lent for
writing come back quarantined (their writers may outlive the daemon). What that means for
who owns which page: the ownership contract in :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._wire.protocol import meta_problem
from .pool import HostPool
from .state import StoredObject

__all__ = ["Plan", "plan"]


@dataclass
class Plan:
    """What a restore adopts: the surviving objects with their parent's serial (seal order:
    a parent before its children), the extents lent for writing to quarantine, the live
    extents of each pool (its allocator's), and the highest serial a record named."""

    survivors: list[tuple[StoredObject, Any]]
    held: list[tuple[int, int, int]]
    live: list[list[tuple[int, int]]]
    top_serial: int


def plan(
    records: Iterable[dict[str, Any]],
    pools: list[HostPool],
    pools_for: Callable[[str], list[HostPool]],
    lent: Iterable[tuple[int, int, int]] = (),
    *,
    report: dict[str, list[str]] | None = None,
    dropped: set[int] | None = None,
    verify: bool = False,
) -> Plan:
    """Which sealed objects of a previous daemon (records in seal order) come back, into
    ``pools``; ``lent`` (pool, start, npages), the pages it had lent for writing, are to go
    into the timed quarantine (their writers may still be copying); everything else is free.

    Nothing a record says is trusted: a record that does not describe an object inside its
    pool is dropped, and so is one in a pool its namespace may not live in (``pools_for``: a
    tenant pool's namespaces changed); of two records of one key the later seal wins; of two
    whose pages overlap, the later seal wins (the earlier one's pages hold the later one's
    bytes); a block whose parent was dropped (``dropped``: serials the journal already
    dropped) goes too. With ``verify`` (the journal was damaged), objects sealed with
    checksums are hashed again and dropped when their bytes differ. Why each object was
    dropped goes into ``report`` (reason -> ["namespace/key", ...])."""
    report = {} if report is None else report
    gone = set(dropped or ())

    def drop(reason: str, what: str, serial: Any = None) -> None:
        report.setdefault(reason, []).append(what)
        if isinstance(serial, int):
            gone.add(serial)

    objs: list[tuple[StoredObject, Any]] = []
    for rec in records:
        try:
            idx = rec["pool"]
            if idx.__class__ is not int or not 0 <= idx < len(pools):
                raise ValueError(f"pool {idx!r} does not exist")
            obj = StoredObject.from_record(rec, pools)
            _check(obj)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            what = rec.get("namespace"), rec.get("key") if isinstance(rec, dict) else (None, None)
            serial = rec.get("serial") if isinstance(rec, dict) else None
            why = f"malformed record ({type(exc).__name__}: {exc})"
            drop(why, f"{what[0]}/{what[1]}", serial)
            continue
        if obj.pool not in pools_for(obj.namespace):  # [tenant_pools] changed
            name = f"{obj.namespace}/{obj.key}"
            drop("its namespace lives in another pool now", name, obj.serial)
            continue
        objs.append((obj, rec.get("parent")))
    latest: dict[tuple[str, str], StoredObject] = {}
    for obj, _ in objs:
        ident = (obj.namespace, obj.key)
        if ident not in latest or obj.serial > latest[ident].serial:
            latest[ident] = obj
    taken: list[list[tuple[int, int]]] = [[] for _ in pools]
    keep: set[int] = set()
    for obj, _ in sorted(objs, key=lambda op: -op[0].serial):  # the latest seal first
        name = f"{obj.namespace}/{obj.key}"
        if latest[(obj.namespace, obj.key)] is not obj:
            drop("a later record sealed the same key", name, obj.serial)
            continue
        if obj.serial in keep:
            drop("duplicate serial", name)
            continue
        ext = taken[obj.pool.index]
        i = bisect.bisect_left(ext, (obj.start, 0))
        after = i < len(ext) and ext[i][0] < obj.start + obj.npages
        before = i > 0 and ext[i - 1][0] + ext[i - 1][1] > obj.start
        if after or before:
            drop("its pages overlap a later object's", name, obj.serial)
            continue
        ext.insert(i, (obj.start, obj.npages))
        keep.add(obj.serial)
    candidates = [(obj, parent) for obj, parent in objs if obj.serial in keep]
    if verify:
        candidates = _verify(candidates, drop)
    survivors = []
    live: list[list[tuple[int, int]]] = [[] for _ in pools]
    for obj, parent in candidates:  # seal order: a parent is decided before its children
        if parent is not None and parent in gone:
            drop("its parent block was dropped", f"{obj.namespace}/{obj.key}", obj.serial)
            continue
        survivors.append((obj, parent))
        live[obj.pool.index].append((obj.start, obj.npages))
    held = _disjoint(lent, live, [p.allocator.capacity for p in pools])
    for idx, start, npages in held:
        live[idx].append((start, npages))
    top = max([o.serial for o, _ in objs] + [0])
    return Plan(survivors, held, live, top)


def _check(obj: StoredObject) -> None:
    """Raise ValueError unless ``obj`` (from a journal record) is an object inside its pool."""
    pool = obj.pool
    ints = (obj.serial, obj.start, obj.npages, obj.nbytes, obj.consumers)
    if any(v.__class__ is not int for v in ints):
        raise ValueError("serial, start, npages, nbytes and consumers must be integers")
    if obj.start < 0 or obj.npages < 1 or obj.start + obj.npages > pool.allocator.capacity:
        raise ValueError(f"pages {obj.start}+{obj.npages} are not inside pool {pool.index}")
    if not (
        isinstance(obj.namespace, str) and obj.namespace and isinstance(obj.key, str) and obj.key
    ):
        raise ValueError("namespace and key must be non-empty strings")
    if obj.consumers < 1 or not isinstance(obj.created_at, (int, float)):
        raise ValueError("consumers must be at least 1")
    if obj.meta is not None and not isinstance(obj.meta, dict):
        raise ValueError("meta must be a map")
    problem = meta_problem(obj.meta)
    if problem is not None:
        raise ValueError(problem)
    lo, hi = obj.start * pool.page_size, (obj.start + obj.npages) * pool.page_size
    if not obj.buffers or sum(n for _, n in obj.buffers.values()) != obj.nbytes:
        raise ValueError("buffers do not add up to nbytes")
    for name, (off, n) in obj.buffers.items():
        if not isinstance(name, str) or n < 0 or off < lo or off + n > hi:
            raise ValueError(f"buffer {name!r} lies outside the object's pages")
    sums = obj.checksums
    if sums is not None:  # one well-formed checksum (either kind) per buffer
        from .._wire.checksum import validate

        validate(sums, obj.buffers)
    if obj.parent_key is not None and not isinstance(obj.parent_key, str):
        raise ValueError("parent_key must be a key")


def _verify(objs: list, drop: Callable[..., None]) -> list:
    """The objects whose checksummed bytes still match (each buffer hashed again). Objects
    without checksums cannot be vouched for after a damaged journal (a lost unlink record
    leaves no trace when the pages' later owner is gone too): dropped."""
    import posix_ipc

    from .disk_store import PoolPages, PoolUnusable

    # pread on the segment, never a mapping: a group member may truncate a shared pool,
    # and a load past its end would be a SIGBUS that keeps the daemon from starting
    opened: dict[int, PoolPages | None] = {}
    out = []
    try:
        for obj, parent in objs:
            if obj.checksums is None:
                drop(
                    "it was sealed without checksums, so its bytes cannot be checked",
                    f"{obj.namespace}/{obj.key}",
                    obj.serial,
                )
                continue
            if obj.pool.index not in opened:
                try:
                    shm = posix_ipc.SharedMemory(obj.pool.name, posix_ipc.O_RDONLY, read_only=True)
                except posix_ipc.PermissionsError:  # a tenant's pool, its user's alone
                    opened[obj.pool.index] = None
                else:
                    opened[obj.pool.index] = PoolPages(obj.pool.index, shm.fd, obj.pool.size)
            pages = opened[obj.pool.index]
            if pages is None:
                drop(
                    "its pool cannot be read by the daemon (a tenant pool owned by its "
                    "user), so its bytes cannot be checked",
                    f"{obj.namespace}/{obj.key}",
                    obj.serial,
                )
                continue
            try:
                ok = all(
                    _matches(pages, off, n, obj.checksums[name])
                    for name, (off, n) in obj.buffers.items()
                )
            except PoolUnusable:
                drop(
                    "its pool was truncated, so its bytes cannot be read",
                    f"{obj.namespace}/{obj.key}",
                    obj.serial,
                )
                continue
            if ok:
                out.append((obj, parent))
            else:
                drop(
                    "its bytes no longer match its checksums",
                    f"{obj.namespace}/{obj.key}",
                    obj.serial,
                )
    finally:
        for pages in opened.values():
            if pages is not None:
                pages.close()
    return out


def _disjoint(
    lent: Iterable[tuple[int, int, int]], live: list[list[tuple[int, int]]], capacities: list[int]
) -> list[tuple[int, int, int]]:
    """The ``lent`` extents (pool, start, npages) that lie inside their pool and overlap no
    ``live`` extent (per pool: (start, npages)) nor each other; a journal that says
    otherwise is wrong, and the sealed objects win."""
    taken = [sorted(ext) for ext in live]
    out = []
    for idx, start, npages in sorted(lent):
        if not (
            0 <= idx < len(capacities)
            and 0 <= start
            and 0 < npages
            and start + npages <= capacities[idx]
        ):
            continue
        ext = taken[idx]
        i = bisect.bisect_left(ext, (start, 0))
        if i < len(ext) and ext[i][0] < start + npages:
            continue
        if i > 0 and ext[i - 1][0] + ext[i - 1][1] > start:
            continue
        ext.insert(i, (start, npages))
        out.append((idx, start, npages))
    return out


def _matches(pages, offset: int, nbytes: int, recorded) -> bool:
    """Whether the pool's bytes hash to ``recorded`` (either checksum kind); a malformed
    record does not vouch for anything."""
    try:
        return pages.matches(offset, nbytes, recorded)
    except ValueError:
        return False
