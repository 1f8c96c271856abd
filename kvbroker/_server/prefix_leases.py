"""Prefix matches: the run of leading blocks a request names, and the read lease over it.

A match of N blocks is one read lease over all of them (the ownership contract:
:mod:`kvbroker._server.state`). It runs per request for hundreds of blocks, so per-block
work is done in C: the lookups and one read of each matched block (its parent, shape, row and
recency) by ``kvbroker._prefixscan`` (csrc/prefixscan.c), or, where that was not built, by
C-driven iterators (``map``, ``attrgetter``, ``b"".join``: a pass per field), never by Python
statements; and most blocks are not pinned one by one:

*Lazy leases.* When the matched blocks form a chain — each block's ``parent`` is the block
before it — only the last block (the leaf) counts the lease as a reader. The same holds for
``s`` chains interleaved block by block (each block's parent is the block ``s`` before it:
what ``match_kv`` asks for when this rank reads ``s`` source TP shards), whose last ``s``
blocks are the leaves; ``Lease.lazy`` is that ``s`` (0: eager). The others are
their ancestors, each with a linked child in the lease, and a block with children is never
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
from itertools import chain as chained
from itertools import islice, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .directory import Directory
    from .leases import LeaseTable
    from .state import Lease, Session, StoredObject

__all__ = [
    "count_query",
    "lazy_readers",
    "lend_prefix",
    "matched_run",
    "materialize",
    "materialize_holding",
]

_parent, _shape, _row = attrgetter("parent"), attrgetter("shape"), attrgetter("row")


def matched_run(directory: Directory, namespace: str, keys: list[Any]) -> list[StoredObject]:
    """The sealed objects of the leading ``keys`` of ``namespace`` up to the first one that
    is not published (a key that is not a string never is)."""
    space = directory.namespace(namespace)
    if not space or not keys:
        return []
    return _run(space, keys)  # (a list: validate_args checked it)


def _run_py(space: dict[str, StoredObject], keys: list[Any]) -> list[StoredObject]:
    """``_prefixscan.run``: ``space``'s values of the leading ``keys`` up to the first key
    that is not a string or not in it."""
    try:
        found = list(map(space.get, keys))  # a hashable non-string key gets None: a miss
    except TypeError:  # an unhashable key (a list, a map): the run ends before it
        found = [space.get(k) if k.__class__ is str else None for k in keys]
    try:
        del found[found.index(None) :]
    except ValueError:
        pass  # every key matched
    return found


def lend_prefix(
    directory: Directory,
    leases: LeaseTable,
    session: Session,
    found: list[StoredObject],
    ttl: float,
) -> tuple[Lease, tuple[str, ...], bytes | None, int]:
    """Owns: one read lease on the matched blocks ``found`` (at least one), pinning them (or
    only the leaves of a lazy one). Returns it, the first block's buffer names, every block's
    packed extent row joined (None when the blocks differ in names) and the bytes leased."""
    stride, joined = _lend_scan(found, time.time())  # (every block's last_access set)
    directory.pin_leaves(found[-stride:] if stride else found)
    lease = leases.lend("read", session, found[0], ttl)
    lease.more = tuple(islice(found, 1, None))
    if stride:
        leases.make_lazy(lease, stride)
    if joined is not None:  # (one shape: blocks matched before, of the same names and size)
        shape = found[0].shape
        return lease, shape[0], joined, shape[1] * len(found)
    # Blocks matched for the first time since their seal, or of other names or sizes.
    rows = [obj.compact_extents()[1] for obj in found]
    shapes = list(map(_shape, found))
    shape = shapes[0]
    same = all(names == shape[0] for names, _ in shapes)  # sizes differ, names may not
    return lease, shape[0], b"".join(rows) if same else None, sum(n for _, n in shapes)


def _lend_scan_py(found: list[StoredObject], now: float) -> tuple[int, bytes | None]:
    """``_prefixscan.lend_scan``: set every block's ``last_access`` to ``now``; returns
    :func:`_chains`' stride and every block's row joined when all share the first block's
    (known) shape, else None."""
    # Recency as an eager pin records it, on every block (the LRU does not hold ancestors).
    deque(map(setattr, found, repeat("last_access"), repeat(now)), 0)
    shapes = list(map(_shape, found))
    shape = shapes[0] if shapes else None
    # Shapes are shared tuples (StoredObject.compact_extents): mostly an identity test.
    same = shape is not None and shapes.count(shape) == len(shapes)
    return _chains(found), b"".join(map(_row, found)) if same else None


def count_query(c: dict[str, int], asked: int, matched: int, block_tokens: int) -> None:
    """One prefix query in the counters ``c``: blocks hit and missed, tokens hit."""
    c["prefix_queries"] += 1
    c["prefix_hit_blocks"] += matched
    c["prefix_miss_blocks"] += asked - matched
    c["prefix_hit_tokens"] += matched * block_tokens
    c["hits" if matched else "misses"] += 1


def _chains(found: list[StoredObject]) -> int:
    """``s`` when ``found`` is ``s`` chains interleaved block by block (each block's parent
    is the block ``s`` before it; 1: one chain), else 0."""
    if len(found) < 2:
        return 0
    parents = list(map(_parent, found))
    try:  # the first block whose parent is the first block: the second row's first
        stride = parents.index(found[0], 1)  # (identity: blocks define no __eq__)
    except ValueError:
        return 0
    # (a list compare tests identity first: no call per block)
    return stride if parents[stride:] == found[:-stride] else 0


def materialize(leases: LeaseTable, lease: Lease) -> None:
    """Make a lazy lease eager: every block it holds counts it as a reader."""
    leases.unlazy(lease)
    leaves, lease.lazy = lease.lazy, 0
    for obj in lease.objects()[:-leaves]:  # the leaves count it already
        obj.readers += 1


def materialize_holding(leases: LeaseTable, obj: StoredObject) -> None:
    """Materialize the lazy leases that hold ``obj`` (before it is unlinked or reported).

    A lazy lease holds a block either as a leaf (a reader) or as an ancestor (a child):
    a block with neither is in none. A chain's blocks have consecutive depths, so a lease
    whose first block is at depth ``d`` can hold ``obj`` only at index ``obj.depth - d``
    (of ``s`` interleaved chains: at one index per chain): one test per lease and chain,
    not a scan of its blocks."""
    if not leases.lazy or not (obj.readers or obj.children):
        return
    depth = obj.depth
    holding = [
        ls
        for ls in leases.lazy.values()
        if ls.lazy > 1 or 0 <= depth - ls.obj.depth <= len(ls.more)
    ]
    for lease in holding:
        if _holds(lease, obj, depth):
            materialize(leases, lease)


def _holds(lease: Lease, obj: StoredObject, depth: int) -> bool:
    more, stride = lease.more, lease.lazy
    for chain in range(stride):
        first = more[chain - 1] if chain else lease.obj
        at = chain + stride * (depth - first.depth)
        if 0 <= at <= len(more) and (more[at - 1] if at else lease.obj) is obj:
            return True
    return False


def lazy_readers(leases: LeaseTable) -> Counter[StoredObject]:
    """The readers the lazy leases add to their blocks but the leaves (which count their
    own): what materializing every one of them would add, nothing changed. Leases over the
    same span are counted once, times their number: many requests matching one prefix cost
    one walk. A span is named by each of its ``s`` chains' first and last block (a chain is
    its leaf's ancestors) and its length (which says where a partial last row ends)."""
    spans: dict[tuple, list] = {}
    for lease in leases.lazy.values():
        s, more = lease.lazy, lease.more
        key = (s, len(more), id(lease.obj), *map(id, more[: s - 1]), *map(id, more[-s:]))
        span = spans.get(key)
        if span is None:
            spans[key] = [lease, 1]
        else:
            span[1] += 1
    readers: Counter[StoredObject] = Counter()
    for lease, n in spans.values():
        if lease.lazy == 1:  # one chain: each block once
            readers.update(dict.fromkeys(chained((lease.obj,), lease.more[:-1]), n))
        else:  # (a block may stand twice in interleaved chains: count each place)
            for obj in lease.objects()[: -lease.lazy]:
                readers[obj] += n
    return readers


try:  # the C twins (csrc/prefixscan.c): one read of each block instead of a pass per field
    from .._prefixscan import lend_scan as _lend_scan
    from .._prefixscan import run as _run
except ImportError:  # not built (no compiler at install): the same results, slower
    _run, _lend_scan = _run_py, _lend_scan_py
