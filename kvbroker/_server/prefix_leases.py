"""Prefix matches: the run of leading blocks a request names, and the read lease over it.

A match of N blocks is one read lease over all of them (the ownership contract:
:mod:`kvbroker._server.state`). It runs per request for hundreds of blocks, so per-block
work is done by C loops (``map`` over the namespace's dict, ``attrgetter``, ``b"".join``)
rather than Python statements, and most blocks are not pinned one by one:

*Lazy leases.* When the matched blocks form a chain — each block's ``parent`` is the block
before it — only the last block (the leaf) counts the lease as a reader. The others are
its ancestors, each with a linked child in the chain, and a block with children is never
in the LRU (``link_sealed`` takes a parent out; it goes back only when its last child is
unlinked): LRU, watermark and quota eviction cannot take them, nor can ``evict`` (it keeps
parents whose children stay). Two paths unlink a block regardless of its children — the
replacement of its key (``link_sealed``) and a consume — so ``Broker._unlink`` first
*materializes* every lazy lease holding the block: each of its blocks then counts it as a
reader, as an eager lease's do, and it ends as one. Until then the chain stays linked, so
the argument holds. ``lookup`` reports ``readers``: it materializes the leases holding
its object first too. ``list`` and ``evict`` add the readers the lazy leases stand for
(:func:`lazy_readers`) and change nothing (``stat``'s occupancy map reads the leases).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from itertools import chain as chained, islice, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .broker import Broker
    from .state import Lease, Session, StoredObject

__all__ = ["lend_prefix", "matched_run", "materialize", "materialize_holding", "lazy_readers"]

_parent, _shape, _row = attrgetter("parent"), attrgetter("shape"), attrgetter("row")


def matched_run(b: Broker, namespace: str, keys: list[Any]) -> list[StoredObject]:
    """The sealed objects of the leading ``keys`` of ``namespace`` up to the first one that
    is not published (a key that is not a string never is)."""
    space = b.by_namespace.get(namespace)
    if not space or not keys:
        return []
    try:
        found = list(map(space.get, keys))  # a hashable non-string key gets None: a miss
    except TypeError:  # an unhashable key (a list, a map): the run ends before it
        found = [space.get(k) if k.__class__ is str else None for k in keys]
    try:
        del found[found.index(None):]
    except ValueError:
        pass  # every key matched
    return found


def lend_prefix(b: Broker, session: Session, found: list[StoredObject],
                ttl: float) -> tuple[Lease, tuple[str, ...], bytes | None, int]:  # fmt: skip
    """One read lease on the matched blocks ``found`` (at least one); returns it, the first
    block's buffer names, every block's packed extent row joined (None when the blocks
    differ in names) and the bytes leased."""
    now = time.time()
    lru_pop = b._lru.pop
    # (a list compare tests identity first: no call per block)
    chain = len(found) > 1 and list(map(_parent, islice(found, 1, None))) == found[:-1]
    if chain:
        leaf = found[-1]
        leaf.readers += 1
        lru_pop(leaf.serial, None)
        # Recency as an eager pin records it (the LRU itself does not hold the ancestors).
        deque(map(setattr, found, repeat("last_access"), repeat(now)), 0)
    else:
        for obj in found:
            obj.readers += 1
            obj.last_access = now
            lru_pop(obj.serial, None)
    lease = b.new_lease("read", session, found[0], ttl)
    lease.more = tuple(islice(found, 1, None))
    if chain:
        lease.lazy = True
        b.lazy_leases[lease.id] = lease
    shapes = list(map(_shape, found))
    shape = shapes[0]
    # Shapes are shared tuples (StoredObject.compact_extents): mostly an identity test.
    if shape is not None and shapes.count(shape) == len(shapes):
        return lease, shape[0], b"".join(map(_row, found)), shape[1] * len(shapes)
    # Blocks matched for the first time since their seal, or of other names or sizes.
    rows = [obj.compact_extents()[1] for obj in found]
    shapes = list(map(_shape, found))
    shape = shapes[0]
    same = all(names == shape[0] for names, _ in shapes)  # sizes differ, names may not
    return lease, shape[0], b"".join(rows) if same else None, sum(n for _, n in shapes)


def materialize(b: Broker, lease: Lease) -> None:
    """Make a lazy lease eager: every block it holds counts it as a reader."""
    del b.lazy_leases[lease.id]
    lease.lazy = False
    for obj in lease.objects()[:-1]:  # the leaf counts it already
        obj.readers += 1


def materialize_holding(b: Broker, obj: StoredObject) -> None:
    """Materialize the lazy leases that hold ``obj`` (before it is unlinked or reported).

    A lazy lease holds a block either as its leaf (a reader) or as an ancestor (a child):
    a block with neither is in none. A chain's blocks have consecutive depths, so a lease
    whose first block is at depth ``d`` can hold ``obj`` only at index ``obj.depth - d``:
    one test per lease, not a scan of its blocks."""
    if not b.lazy_leases or not (obj.readers or obj.children):
        return
    depth = obj.depth
    for lease in [ls for ls in b.lazy_leases.values()
                  if 0 <= depth - ls.obj.depth <= len(ls.more)]:  # fmt: skip
        at = depth - lease.obj.depth
        if (lease.more[at - 1] if at else lease.obj) is obj:
            materialize(b, lease)


def lazy_readers(b: Broker) -> Counter[StoredObject]:
    """The readers the lazy leases add to their blocks but the leaf (which counts its own):
    what materializing every one of them would add, nothing changed. Leases over the same
    span (its first block and its leaf name it: a chain is its leaf's ancestors) are counted
    once, times their number: many requests matching one prefix cost one walk."""
    spans: dict[tuple[int, int], list] = {}
    for lease in b.lazy_leases.values():
        span = spans.get(key := (id(lease.obj), id(lease.more[-1])))
        if span is None:
            spans[key] = [lease, 1]
        else:
            span[1] += 1
    readers: Counter[StoredObject] = Counter()
    for lease, n in spans.values():
        readers.update(dict.fromkeys(chained((lease.obj,), lease.more[:-1]), n))
    return readers
