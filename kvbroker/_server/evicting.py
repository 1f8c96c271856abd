"""The ``evict`` request: the objects its filter names, and their eviction.

A filter that reads every buffer name (``match_buffers``) costs a regex search per name of
every candidate: thousands of objects of thousands of buffers each is seconds of work, which
would stall every other client on the loop. Past :data:`SLICE_NAMES` names in all, the
candidates are therefore read in slices of that many names, the loop serving other requests
in between (the request is answered as a deferred one, :class:`~.state.Deferred`), and the
objects found are checked again before they go: one unlinked, claimed or held lazily by a
prefix lease meanwhile is not evicted. The disk tier's entries are read the same way, after
the pools' objects (:func:`disk_candidates`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Container, Iterable
from typing import Any

import msgpack

from .._wire import replies as R
from ..errors import BadRequest
from .directory import Directory
from .patterns import client_regex
from .state import Deferred, Session, StoredObject

__all__ = [
    "MAX_LISTED_BYTES",
    "MAX_REPORTED",
    "SCAN_TIMEOUT",
    "SLICE_NAMES",
    "TIERS",
    "check_tier",
    "disk_candidates",
    "disk_filter",
    "info_size",
    "select",
    "victims",
]

MAX_REPORTED = 10_000  # objects an evict reply lists (it counts them all)
# Bytes of objects' infos a list page or an evict reply carries at most: an info carries its
# meta (up to 64 KiB), and a reply of 10,000 of them would pass a reader's write buffer.
MAX_LISTED_BYTES = 4 << 20
SLICE_NAMES = 20_000  # buffer names a match_buffers filter reads per turn of the loop
SCAN_TIMEOUT = 3600.0  # (the slices are bounded; this only bounds the deferral)


def select(
    directory: Directory,
    session: Session,
    namespace: str | None,
    key: str | None,
    match: str | None,
    match_buffers: str | None,
    older_than: float | None,
    all: bool,
    finish: Callable[[list[StoredObject]], R.Evicted],
    finish_later: Callable[[list[StoredObject]], R.Evicted],
) -> R.Evicted:
    """The objects the filter names that ``session`` may evict, handed to ``finish`` (or,
    past :data:`SLICE_NAMES` buffer names to read, found in slices off the request path and
    handed to ``finish_later``: a :class:`~.state.Deferred`)."""
    if not (
        all
        or key is not None
        or match is not None
        or match_buffers is not None
        or older_than is not None
        or namespace is not None
    ):
        raise BadRequest("evict: name what to evict (key, match, namespace, ...) or all")
    if older_than is not None and not 0 <= older_than < math.inf:  # NaN compares false
        raise BadRequest("evict: older_than must be a finite number of seconds, 0 or more")
    key_re = client_regex(match) if match is not None else None
    buf_re = client_regex(match_buffers) if match_buffers is not None else None
    access = session.access
    if namespace is not None and access.can(namespace):
        access.check(namespace, True, "evict")  # readable but not writable: say so
    if key is not None:
        spaces = (namespace,) if namespace is not None else list(directory.by_namespace)
        candidates = [o for o in (directory.get((ns, key)) for ns in spaces) if o]
    else:
        candidates = list(directory.in_namespace(namespace))
    now = time.time()

    def chosen(objs: Iterable[StoredObject]) -> list[StoredObject]:
        out = []
        for obj in objs:
            if not obj.linked or (namespace is not None and obj.namespace != namespace):
                continue
            if not access.can(obj.namespace, write=True):
                continue  # another tenant's (or read-only shared) objects are not ours to free
            if key_re is not None and not key_re.search(obj.key):
                continue
            if older_than is not None and now - obj.created_at < older_than:
                continue
            if buf_re is not None and not any(buf_re.search(n) for n in obj.buffers):
                continue
            out.append(obj)
        return out

    if buf_re is not None and sum(len(o.buffers) for o in candidates) > SLICE_NAMES:

        async def scan() -> list[StoredObject]:
            found, at = [], 0
            while at < len(candidates):
                end, names = at, 0
                while end < len(candidates) and names < SLICE_NAMES:
                    names += len(candidates[end].buffers)
                    end += 1
                found += chosen(candidates[at:end])
                at = end
                await asyncio.sleep(0)  # the other connections' turn
            return found

        raise Deferred(scan, finish_later, SCAN_TIMEOUT)
    return finish(chosen(candidates))


def victims(
    found: list[StoredObject], lazy: Container[StoredObject], dry_run: bool
) -> tuple[R.Evicted, list[StoredObject]]:
    """The reply, and the objects of ``found`` to evict (leaves first): those still linked
    and unleased (``lazy``: held by a lazy prefix lease, which counts as leased)."""
    chosen, skipped = [], 0
    for obj in found:
        if not obj.linked:
            continue  # gone meanwhile (a deferred scan)
        if obj.readers or obj in lazy:
            skipped += 1
        else:
            chosen.append(obj)
    ordered, kept_parents = _leaves_first(chosen)
    reported, size = [], 0
    for obj in ordered[:MAX_REPORTED]:
        size += info_size(obj)
        if reported and size > MAX_LISTED_BYTES:
            break
        reported.append(obj.info())
    nbytes = sum(o.nbytes for o in ordered)
    reply: R.Evicted = {
        "evicted": reported,
        "count": len(ordered),
        "bytes": nbytes,
        "skipped_leased": skipped,
        "skipped_parents": kept_parents,
        "dry_run": dry_run,
    }
    return reply, ordered


TIERS = ("all", "dram", "disk")  # what evict frees: everywhere, the pools only, the disk only


def check_tier(disk: Any, tier: str, op: str = "evict") -> Any:
    """``evict``'s (or ``list``'s) ``tier``, checked; returns the disk tier (None: the daemon
    has none)."""
    if tier not in TIERS:
        raise BadRequest(f"{op}: tier must be one of {', '.join(TIERS)}, not {tier!r}")
    if tier == "disk" and disk is None:
        raise BadRequest(f"{op}: this daemon has no disk tier ([tier.disk] directories)")
    return disk


def tiered(disk: Any, tier: str, chosen: list[StoredObject], reply: dict, dry_run: bool) -> None:
    """With a disk tier, before ``chosen`` are evicted: ``tier`` dram demotes them (kept on
    disk); all counts their disk copies, which go with them, in ``reply["on_disk"]``."""
    reply["on_disk"] = 0
    if disk is None:
        return
    if tier != "dram":
        reply["on_disk"] = sum(disk.copy_of(o) is not None for o in chosen)
    elif not dry_run:
        for obj in chosen:
            disk.demote(obj)


def disk_filter(
    session: Session,
    namespace: str | None,
    key: str | None,
    match: str | None,
    match_buffers: str | None,
    older_than: float | None,
) -> Callable[[Any], bool]:
    """Whether a disk entry is one the filter names that ``session`` may evict."""
    key_re = client_regex(match) if match is not None else None
    buf_re = client_regex(match_buffers) if match_buffers is not None else None
    can, now = session.access.can, time.time()

    def picked(e: Any) -> bool:
        ns, k = e.ident
        rec = e.record
        return (
            (namespace is None or ns == namespace)
            and can(ns, write=True)
            and (key is None or k == key)
            and (key_re is None or key_re.search(k))
            and (older_than is None or now - (rec.get("created_at") or 0) >= older_than)
            and (buf_re is None or any(buf_re.search(n) for n in rec["buffers"]))
        )

    return picked


def disk_candidates(
    disk: Any, picked: Callable[[Any], bool], reads_names: bool
) -> list[Any] | Callable[[], Any]:
    """The disk entries ``picked`` names; or, when it reads every buffer name
    (``reads_names``) of more than :data:`SLICE_NAMES` in all, a coroutine function finding
    them in slices of the loop (as :func:`select` does for the pools' objects: a tenant's
    disk entries of thousands of names each would stall every other client)."""
    entries = list(disk.entries.values())
    if not reads_names or sum(len(e.record["buffers"]) for e in entries) <= SLICE_NAMES:
        return [e for e in entries if picked(e)]

    async def scan() -> list[Any]:
        found, names = [], 0
        for e in entries:
            if picked(e):
                found.append(e)
            names += len(e.record["buffers"])
            if names >= SLICE_NAMES:
                names = 0
                await asyncio.sleep(0)  # the other connections' turn
        return found

    return scan


def on_disk(
    disk: Any,
    directory: Directory,
    found: list[Any],
    tier: str,
    reply: dict,
    dry_run: bool,
) -> None:
    """Drop the disk copies (``disk``: kvbroker._server.disk_tier.DiskTier) ``found``
    (:func:`disk_candidates`) that are still there: all of them (``tier`` disk), or those of
    objects no pool holds now (all). Counted in ``reply``: in ``on_disk`` all, as objects
    those no pool holds."""
    gone = [e for e in found if disk.live(e) and (tier == "disk" or e.ident not in directory)]
    alone = [e for e in gone if e.ident not in directory]
    if not dry_run:
        ids = {id(e) for e in gone}
        disk.evict(lambda e: id(e) in ids)
    reply["on_disk"] += len(gone)
    reply["count"] += len(alone)
    reply["bytes"] += sum(e.nbytes for e in alone)
    size = 0
    for e in alone[: max(0, MAX_REPORTED - len(reply["evicted"]))]:
        info = e.info()
        size += 160 + len(e.ident[0]) + len(e.ident[1]) + len(_pack(info["meta"]))
        if size > MAX_LISTED_BYTES:
            break
        reply["evicted"].append(info)


def _leaves_first(victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
    """Order victims so children go before parents; keep parents whose children stay.

    Returns the ordered victims and how many were kept for having children outside the batch.
    """
    chosen = {o.serial: o for o in victims}
    children_left = {o.serial: o.children for o in victims}
    ready = [o for o in victims if o.children == 0]
    ordered = []
    while ready:
        o = ready.pop()
        ordered.append(o)
        p = o.parent
        if p is not None and p.serial in chosen:
            children_left[p.serial] -= 1
            if children_left[p.serial] == 0:
                ready.append(p)
    return ordered, len(victims) - len(ordered)


def info_size(obj: StoredObject) -> int:
    """About the packed size of ``obj.info()``: its names, its meta packed, the rest."""
    meta = 0 if obj.meta is None else len(_pack(obj.meta))
    return 160 + len(obj.namespace) + len(obj.key) + meta


_pack = msgpack.Packer().pack
