"""The ``evict`` request: the objects its filter names, and their eviction.

A filter that reads every buffer name (``match_buffers``) costs a regex search per name of
every candidate: thousands of objects of thousands of buffers each is seconds of work, which
would stall every other client on the loop. Past :data:`SLICE_NAMES` names in all, the
candidates are therefore read in slices of that many names, the loop serving other requests
in between (the request is answered as a deferred one, :class:`~.state.Deferred`), and the
objects found are checked again before they go: one unlinked, claimed or held lazily by a
prefix lease meanwhile is not evicted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgpack

from .._wire import replies as R
from ..errors import BadRequest
from .patterns import client_regex
from .prefix_leases import lazy_readers
from .state import Deferred, Session, StoredObject

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["MAX_LISTED_BYTES", "MAX_REPORTED", "SLICE_NAMES", "evict", "info_size"]

MAX_REPORTED = 10_000  # objects an evict reply lists (it counts them all)
# Bytes of objects' infos a list page or an evict reply carries at most: an info carries its
# meta (up to 64 KiB), and a reply of 10,000 of them would pass a reader's write buffer.
MAX_LISTED_BYTES = 4 << 20
SLICE_NAMES = 20_000  # buffer names a match_buffers filter reads per turn of the loop
_DEFERRED_TIMEOUT = 3600.0  # (the slices are bounded; this only bounds the deferral)


def evict(b: Broker, session: Session, namespace: str | None, key: str | None,
          match: str | None, match_buffers: str | None, older_than: float | None,
          all: bool, dry_run: bool) -> R.Evicted:  # fmt: skip
    if not (all or key is not None or match is not None or match_buffers is not None
            or older_than is not None or namespace is not None):  # fmt: skip
        raise BadRequest("evict: name what to evict (key, match, namespace, ...) or all")
    if older_than is not None and not 0 <= older_than < math.inf:  # NaN compares false
        raise BadRequest("evict: older_than must be a finite number of seconds, 0 or more")
    key_re = client_regex(match) if match is not None else None
    buf_re = client_regex(match_buffers) if match_buffers is not None else None
    access = session.access
    if namespace is not None and access.can(namespace):
        access.check(namespace, True, "evict")  # readable but not writable: say so
    if key is not None:
        spaces = (namespace,) if namespace is not None else list(b.by_namespace)
        candidates = [o for o in (b.objects.get((ns, key)) for ns in spaces) if o]
    else:
        candidates = list(b.in_namespace(namespace))
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

    def finish(found: list[StoredObject]) -> R.Evicted:
        cleared = all and not (namespace or key or match or match_buffers or older_than)
        return _evict_found(b, found, dry_run, bool(cleared))

    def finish_later(found: list[StoredObject]) -> R.Evicted:
        # Outside Broker.handle's batch: one journal write for the unlinks, as it would be.
        journal = b.journal
        if journal is None or not journal.begin():
            return finish(found)
        try:
            return finish(found)
        finally:
            journal.flush()

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

        raise Deferred(scan, finish_later, _DEFERRED_TIMEOUT)
    return finish(chosen(candidates))


def _evict_found(b: Broker, found: list[StoredObject], dry_run: bool,
                 cleared: bool) -> R.Evicted:  # fmt: skip
    """Evict the objects ``found`` that are still linked and unleased (leaves first)."""
    lazy = lazy_readers(b) if b.lazy_leases else ()  # held lazily: skipped_leased, too
    victims, skipped = [], 0
    for obj in found:
        if not obj.linked:
            continue  # gone meanwhile (a deferred scan)
        if obj.readers or obj in lazy:
            skipped += 1
        else:
            victims.append(obj)
    victims, kept_parents = _leaves_first(victims)
    reported, size = [], 0
    for obj in victims[:MAX_REPORTED]:
        size += info_size(obj)
        if reported and size > MAX_LISTED_BYTES:
            break
        reported.append(obj.info())
    nbytes = sum(o.nbytes for o in victims)
    if not dry_run:
        for obj in victims:
            b.retention.evicted_now(obj, "operator")
            b.evict(obj)
        if cleared and b.on_block is not None:
            b.on_block("cleared", None)  # a router forgets this node's blocks
    return {
        "evicted": reported,
        "count": len(victims),
        "bytes": nbytes,
        "skipped_leased": skipped,
        "skipped_parents": kept_parents,
        "dry_run": dry_run,
    }


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
