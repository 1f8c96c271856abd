"""The ``list`` request: the sealed objects a session may read, in the pools and on the disk
tier, one page at a time.

Which tier each object is in (its ``tier``): ``dram`` (in a pool), ``disk`` (on the disk
tier only: a claim promotes it first) or ``dram+disk`` (in a pool, with a copy on disk: an
eviction keeps it). The ``tier`` filter is ``evict --tier``'s: ``all`` lists every object
once, ``dram`` those in a pool, ``disk`` those with a copy on disk.

Order and pages: the order objects were sealed in (``StoredObject.seq``); an object demoted
to disk keeps its place (its disk entry takes the pool object's ``seq``: a page boundary
never lists it twice), one promoted back is sealed again (a new ``seq``), and the disk
objects a daemon found after a reboot come first (negative ``seq``, in their index's order).
A page resumes after the ``seq`` the previous one ended on.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

import msgpack

from .._wire import replies as R
from .directory import Directory
from .evicting import MAX_LISTED_BYTES, check_tier, info_size
from .patterns import client_regex
from .state import Session

__all__ = ["MAX_LIST", "list_objects"]

MAX_LIST = 10_000  # objects a reply lists at most

_pack = msgpack.Packer().pack


def list_objects(
    directory: Directory,
    disk: Any,
    lazy: Any,
    session: Session,
    namespace: str | None,
    match: str | None,
    limit: int | None,
    after: int | None,
    tier: str,
) -> R.Listed:
    """One page of ``list`` (``disk``: the daemon's DiskTier or None; ``lazy``: the readers
    lazy prefix leases add, by object)."""
    disk = check_tier(disk, tier, "list")
    limit = MAX_LIST if limit is None else max(0, min(limit, MAX_LIST))
    pattern = client_regex(match) if match is not None else None
    can = session.access.can
    if namespace is not None and not can(namespace):
        return {"objects": [], "truncated": False, "next": None}

    def wanted(ns: str, key: str) -> bool:
        return (namespace is not None or can(ns)) and (pattern is None or pattern.search(key))

    out: list[dict[str, Any]] = []
    last, truncated, size = None, False, 0
    for seq, nbytes, describe in heapq.merge(
        _in_pools(directory, disk, namespace, after, tier, wanted, lazy),
        _on_disk_only(directory, disk, namespace, after, tier, wanted),
        key=lambda row: row[0],
    ):
        size += nbytes
        if len(out) == limit or (out and size > MAX_LISTED_BYTES):
            truncated = True
            break
        out.append(describe())
        last = seq
    following = (last if last is not None else after or 0) if truncated else None
    return {"objects": out, "truncated": truncated, "next": following}


def _in_pools(directory, disk, namespace, after, tier, wanted, lazy) -> Iterator[tuple]:
    """(seq, size, info) of the pools' objects listed, in link order (``seq`` rises along
    it: a page resumes after the last object the previous one listed, whatever was sealed
    or freed since)."""
    if tier == "disk" and disk is None:
        return
    for obj in directory.in_namespace(namespace):
        if after is not None and obj.seq <= after:
            continue
        if not wanted(obj.namespace, obj.key):
            continue
        copied = disk is not None and disk.copy_of(obj) is not None
        if tier == "disk" and not copied:
            continue

        def describe(obj=obj, copied=copied) -> dict[str, Any]:
            info = obj.info()
            if lazy:
                info["readers"] += lazy[obj]
            info["tier"] = "dram+disk" if copied else "dram"
            return info

        yield obj.seq, info_size(obj), describe


def _on_disk_only(directory, disk, namespace, after, tier, wanted) -> Iterator[tuple]:
    """(seq, size, info) of the objects on the disk tier only, in ``seq`` order."""
    if disk is None or tier == "dram":
        return
    rows = [
        e
        for e in list(disk.entries.values())
        if e.obj is None
        and (namespace is None or e.ident[0] == namespace)
        and (after is None or e.seq > after)
        and e.ident not in directory
        and wanted(*e.ident)
        and disk.live(e)
    ]
    rows.sort(key=lambda e: e.seq)
    for e in rows:
        meta = e.record.get("meta")
        nbytes = 160 + len(e.ident[0]) + len(e.ident[1]) + (0 if meta is None else len(_pack(meta)))

        def describe(e=e) -> dict[str, Any]:
            return {**e.info(), "tier": "disk"}

        yield e.seq, nbytes, describe
