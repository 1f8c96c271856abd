"""The directory: which object a key names, what is being written, what may be evicted.

:class:`Directory` owns the index of sealed objects (by key and by namespace, in link
order), the reservations being written (*pending*), the LRU of what eviction may take
(sealed, linked objects nobody reads and no block names as parent) and the prefix links
between blocks (``parent``, ``children``, ``depth``). It decides nothing about pages,
charges or leases: the broker (:class:`~kvbroker._server.broker.Broker`) frees an object's
pages when the directory says nothing holds it any more. Who owns and frees what: the
ownership contract in :mod:`kvbroker._server.state`. No I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import count, repeat
from operator import attrgetter
from typing import Any

from .pool import HostPool
from .retention import Retention, RetentionSettings
from .state import StoredObject

__all__ = ["Directory", "DirectoryStatistics"]

_serial = attrgetter("serial")


@dataclass(frozen=True)
class DirectoryStatistics:
    """What the directory holds: sealed objects and reservations, per pool and namespace."""

    objects: int
    pending: int
    evictable: int
    objects_per_pool: dict[int, int]
    # namespace -> (sealed objects, their bytes)
    namespaces: dict[str, tuple[int, int]]
    pending_namespaces: tuple[str, ...]


class Directory:
    """Sealed objects by key and namespace, reservations, the eviction order (the LRU, and
    the sessions' retention after it) and the prefix links."""

    def __init__(
        self, capacities: list[int] | None = None, retention: RetentionSettings | None = None
    ) -> None:
        self.objects: dict[tuple[str, str], StoredObject] = {}
        # The same objects by namespace (key -> object, link order): list, evict and quotas
        # of one namespace cost what that namespace holds, not what the daemon holds.
        self.by_namespace: dict[str, dict[str, StoredObject]] = {}
        self.pending: dict[tuple[str, str], StoredObject] = {}
        # Sealed, linked objects with no reader and no child, least recently used first.
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()
        self._serials = count(1)
        self._link_seq = count(1)  # StoredObject.seq: the index's iteration order
        # Sessions' retained objects (kvbroker._server.retention): out of the LRU, evicted
        # only once it has none left, in their own order. ``capacities``: bytes per pool.
        self.retention = Retention(list(capacities or ()), self._lru, retention)

    # ------------------------------------------------------------------ reading
    def get(self, ident: tuple[str, str]) -> StoredObject | None:
        return self.objects.get(ident)

    def __contains__(self, ident: tuple[str, str]) -> bool:
        return ident in self.objects

    def taken(self, ident: tuple[str, str]) -> bool:
        """Whether ``ident`` is sealed or being written."""
        return ident in self.objects or ident in self.pending

    def in_namespace(self, namespace: str | None) -> Iterable[StoredObject]:
        """The sealed objects of ``namespace`` (None: all), in link order."""
        if namespace is None:
            return self.objects.values()
        return self.by_namespace.get(namespace, {}).values()

    def namespace(self, namespace: str) -> dict[str, StoredObject] | None:
        """Key -> sealed object of ``namespace`` (None when it holds none); read only."""
        return self.by_namespace.get(namespace)

    def evictable(self, pool: HostPool | None = None) -> Iterator[StoredObject]:
        """What eviction may take, least recently used first (of ``pool``, unless None)."""
        if pool is None:
            return iter(self._lru.values())
        return (o for o in self._lru.values() if o.pool is pool)

    def is_evictable(self, obj: StoredObject) -> bool:
        return obj.serial in self._lru

    def retained(self, pool: HostPool | None = None) -> Iterator[StoredObject]:
        """What eviction may take once :meth:`evictable` has nothing left: sessions'
        retained objects, lowest priority first, least recently used first."""
        return self.retention.victims(None if pool is None else pool.index)

    def evicting(self, obj: StoredObject, why: str) -> None:
        """``obj`` is about to be evicted (``why``: pool_full, watermark, quota, operator):
        counted when a session retained it."""
        self.retention.evicted_now(obj, why)

    def records(self) -> list[dict[str, Any]]:
        """Every sealed, linked object as a journal record, in link order."""
        return [obj.to_record() for obj in self.objects.values()]

    # ------------------------------------------------------------------ transitions
    def new_object(
        self,
        ident: tuple[str, str],
        pool: HostPool,
        start: int,
        npages: int,
        layout: dict[str, tuple[int, int]],
        meta: dict | None,
    ) -> StoredObject:
        """An unsealed object on ``npages`` pages of ``pool`` from ``start``, its buffers at
        the ``layout`` offsets (relative to the extent), with a fresh serial. Owns: nothing
        yet (the caller reserves or links it)."""
        base = start * pool.page_size
        buffers = {name: (base + off, n) for name, (off, n) in layout.items()}
        nbytes = sum(n for _, n in layout.values())
        return StoredObject(
            ident[0], ident[1], pool, start, npages, nbytes, buffers, meta, next(self._serials)
        )

    def reserve(self, obj: StoredObject) -> None:
        """Owns: ``obj`` as its key's reservation. Frees: nothing."""
        self.pending[(obj.namespace, obj.key)] = obj

    def unreserve(self, obj: StoredObject) -> None:
        """Frees: ``obj``'s reservation (the caller seals it)."""
        del self.pending[(obj.namespace, obj.key)]

    def discard(self, obj: StoredObject) -> None:
        """Frees: ``obj``'s reservation and the session it was to be retained by (the caller
        frees or quarantines its pages)."""
        del self.pending[(obj.namespace, obj.key)]
        self.retention.pending.pop(obj.serial, None)

    def link(self, obj: StoredObject) -> None:
        """Owns: ``obj`` as its key's sealed object (the caller unlinked any older one), in the
        LRU, under its parent (which leaves the LRU until its last child goes). Frees:
        nothing."""
        obj.sealed = True
        obj.linked = True
        obj.last_access = time.time()
        obj.seq = next(self._link_seq)
        self._index(obj)
        if obj.parent_key is not None:
            # An absent parent (evicted while we wrote) leaves nothing to keep whole.
            parent = self.objects.get((obj.namespace, obj.parent_key))
            if parent is not None and parent is not obj:
                self._adopt_child(parent, obj)
        # Retained by the session it was reserved for, or the LRU's (under its parent
        # already: a chain loses retention from its leaf).
        self.retention.adopt(obj)

    def adopt(self, obj: StoredObject, parent: StoredObject | None) -> None:
        """Owns: a restored sealed object (its link order continues from the last), under
        ``parent``. Frees: nothing."""
        if parent is not None:
            self._adopt_child(parent, obj)
        obj.linked = True
        obj.seq = next(self._link_seq)
        self._index(obj)
        if obj.children == 0:
            self._lru[obj.serial] = obj

    def serials_from(self, first: int) -> None:
        """New objects get serials from ``first`` on (a restore continues the old ones)."""
        self._serials = count(first)

    def unlink(self, obj: StoredObject) -> bool:
        """Frees: ``obj``'s key, its place in the LRU and its parent's hold (a parent left
        childless joins the LRU at its oldest end: a chain shrinks from its leaf). Returns
        whether it was linked; the caller frees its pages once no reader holds them."""
        if not obj.linked:
            return False
        obj.linked = False
        del self.objects[(obj.namespace, obj.key)]
        space = self.by_namespace[obj.namespace]
        del space[obj.key]
        if not space:
            del self.by_namespace[obj.namespace]
        self.retention.forget(obj)  # out of the LRU and of every session's retention
        parent, obj.parent = obj.parent, None
        if parent is not None and parent.linked:
            parent.children -= 1
            if parent.children == 0 and parent.readers == 0 and not self.retention.keeps(parent):
                self._lru[parent.serial] = parent
                self._lru.move_to_end(parent.serial, last=False)
        return True

    def pin(self, obj: StoredObject, now: float | None = None) -> None:
        """Owns: one more reader of ``obj`` (out of the LRU: neither evicted nor reused)."""
        obj.readers += 1
        obj.last_access = time.time() if now is None else now
        self._lru.pop(obj.serial, None)

    def pin_leaves(self, objs: Iterable[StoredObject]) -> None:
        """Owns: one more reader of each of ``objs`` (a prefix lease's; ``last_access`` is
        the caller's)."""
        lru_pop = self._lru.pop
        for obj in objs:
            obj.readers += 1
            lru_pop(obj.serial, None)

    def unpin(self, obj: StoredObject, consume: bool) -> bool:
        """Frees: one reader of ``obj`` (and with ``consume``, one of its consumers); back into
        the LRU, most recently used, when nothing holds it. Returns whether the object is now
        to go: consumed (the caller unlinks it) or unlinked earlier and unread (the caller
        frees its pages)."""
        obj.readers -= 1
        if obj.linked:
            if consume:
                obj.consumers -= 1
                if obj.consumers <= 0:
                    return True
            if obj.readers == 0 and obj.children == 0 and not self.retention.keeps(obj):
                self._lru[obj.serial] = obj
            return False
        return obj.readers == 0

    def unpin_oldest(self, obj: StoredObject) -> bool:
        """:meth:`unpin` (no consume), but back at the LRU's oldest end: an object whose copy
        was just written to disk (kvbroker._server.disk_tier) is the cheapest to evict."""
        if self.unpin(obj, False):
            return True
        if obj.serial in self._lru:
            self._lru.move_to_end(obj.serial, last=False)
        return False

    def touch(self, found: list[StoredObject]) -> None:
        """The evictable ones of ``found`` to the LRU's newest end, in order (what a match
        that holds nothing does: a prefix a scheduler keeps finding is not evicted first)."""
        lru = self._lru
        there = list(filter(None, map(lru.pop, map(_serial, found), repeat(None))))
        lru.update(zip(map(_serial, there), there, strict=True))

    def _index(self, obj: StoredObject) -> None:
        self.objects[(obj.namespace, obj.key)] = obj
        space = self.by_namespace.setdefault(obj.namespace, {})
        space.pop(obj.key, None)  # link order: a replacement goes last
        space[obj.key] = obj

    def _adopt_child(self, parent: StoredObject, obj: StoredObject) -> None:
        obj.parent, obj.depth = parent, parent.depth + 1
        parent.children += 1
        self._lru.pop(parent.serial, None)  # a parent goes only after its children

    # ------------------------------------------------------------------ statistics
    def statistics(self) -> DirectoryStatistics:
        per_pool: dict[int, int] = {}
        namespaces: dict[str, tuple[int, int]] = {}
        for namespace, space in self.by_namespace.items():
            nbytes = 0
            for obj in space.values():
                nbytes += obj.nbytes
                per_pool[obj.pool.index] = per_pool.get(obj.pool.index, 0) + 1
            namespaces[namespace] = (len(space), nbytes)
        return DirectoryStatistics(
            objects=len(self.objects),
            pending=len(self.pending),
            evictable=len(self._lru),
            objects_per_pool=per_pool,
            namespaces=namespaces,
            pending_namespaces=tuple(ns for ns, _ in self.pending),
        )
