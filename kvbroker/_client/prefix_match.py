"""What a prefix match holds: one read lease over the matched blocks of
:meth:`kvbroker.prefix.PrefixCache.match` (:class:`PrefixMatch`) and of
:meth:`~kvbroker.prefix.PrefixCache.match_kv` (:class:`KVPrefixMatch`, which loads this TP
rank's heads into a paged cache), and the block layout both sides of ``publish_kv`` /
``match_kv`` agree on. Public through :mod:`kvbroker.prefix`, whose module doc says who owns
what; see also ``docs/design.md``.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import TYPE_CHECKING, Any

from .copy import _np
from .engine import default_engine
from .paged import _block_index, _whole_rows
from .._wire.names import check_infix, kv_buffer_name
from .tp import Piece, shard_heads
from ..errors import BadRequest, KVBrokerError, LayoutMismatch
from ..layout import Layout, check_compatible

if TYPE_CHECKING:
    from .client import Client

__all__ = ["MatchedBlock", "PrefixMatch", "KVPrefixMatch", "SHARD_META_TAG"]

SHARD_META_TAG = "kvbroker.prefix.kv"  # meta key marking (and versioning) a publish_kv block


class MatchedBlock:
    """Read-only views of one matched block, valid while its :class:`PrefixMatch` is held."""

    __slots__ = ("_match", "_extents")

    def __init__(self, match: PrefixMatch, extents: dict[str, tuple[int, int, int]]) -> None:
        self._match = match
        self._extents = extents

    def __getitem__(self, name: str):
        if self._match.released:
            raise KVBrokerError("the prefix match was released; its views are gone")
        pool, offset, nbytes = self._extents[name]
        return self._match.client.pool_view(pool, offset, nbytes)

    def __iter__(self):
        return iter(self._extents)

    def keys(self):
        return self._extents.keys()


class PrefixMatch:
    """One read lease on the longest published prefix; release it once copied. A match
    asked with ``hold=False`` only counts: no lease, no blocks to read."""

    def __init__(self, client: Client, reply: dict, block_size: int, asked_at: float) -> None:
        self.client = client
        self.block_size = block_size
        self.lease: int | None = reply["lease"]
        self.ttl: float = reply["ttl"]
        # the first block's meta; the rest share it unless the daemon sent one per block
        self._metas: list = reply.get("metas") or [None]
        self.meta: dict | None = self._metas[0]
        self._names = reply["names"]
        self._packed: bytes | None = reply.get("packed")
        # one int64 row per block, parsed on first use (none when not held)
        self._rows: list | None = None if self._packed is not None else reply["blocks"]
        self._count: int = reply["matched"]
        self._blocks: list[MatchedBlock] | None = None
        self._safe_until = asked_at + 0.9 * self.ttl
        self.released = self.lease is None

    @property
    def _raw(self) -> list:
        """Per block: a flat list [pool, offset, nbytes, ...] in ``names`` order, or a map."""
        if self._rows is None:
            width = 1 + 2 * len(self._names)
            table = _np().frombuffer(self._packed, dtype="<i8").reshape(-1, width)
            self._rows = table.tolist()
        return self._rows

    def extents(self) -> tuple[list[str], Any]:
        """The extents of every key this match leases, without a view per buffer: ``(names,
        rows)``, ``rows`` an int64 array ``[keys, 1 + 2·len(names)]`` of ``pool, offset,
        nbytes, offset, nbytes, ...`` in ``names`` order (the daemon's compact reply), or a
        per-key list of ``{name: (pool, offset, nbytes)}`` maps when the keys' buffers
        differ. Valid while the match is held."""
        np = _np()
        names = list(self._names)
        if self._packed is not None:
            return names, np.frombuffer(self._packed, dtype="<i8").reshape(-1, 1 + 2 * len(names))
        raw = self._raw
        if raw and isinstance(raw[0], dict):
            return names, [{n: tuple(e) for n, e in r.items()} for r in raw]
        return names, np.asarray(raw, dtype=np.int64).reshape(-1, 1 + 2 * len(names))

    @property
    def blocks(self) -> list[MatchedBlock]:
        if self.lease is None and self._count:
            raise KVBrokerError(
                "this prefix match was asked with hold=False: it holds no "
                "lease and has no blocks to read; match with hold=True"
            )
        if self._blocks is None:  # built on first use: a caller may only want the count
            out = []
            for raw in self._raw:
                if isinstance(raw, dict):
                    ext = {n: tuple(e) for n, e in raw.items()}
                else:
                    pool = raw[0]
                    ext = {
                        n: (pool, raw[1 + 2 * i], raw[2 + 2 * i]) for i, n in enumerate(self._names)
                    }
                out.append(MatchedBlock(self, ext))
            self._blocks = out
        return self._blocks

    def meta_of(self, i: int) -> dict | None:
        """Block ``i``'s meta (blocks of one run may differ: a writer chose each)."""
        if not 0 <= i < self._count:
            raise IndexError(f"block {i} is outside the {self._count} matched")
        return self._metas[i] if len(self._metas) > 1 else self._metas[0]

    @property
    def num_blocks(self) -> int:
        return self._count

    @property
    def num_tokens(self) -> int:
        return self._count * self.block_size

    def renew(self, ttl: float | None = None) -> None:
        if self.lease is not None:
            asked_at = time.monotonic()
            ((_, granted),) = self.client.ops.renew([self.lease], ttl)["expires_in"]
            self._safe_until = asked_at + 0.9 * granted

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if time.monotonic() < self._safe_until:
            self.client.ops.release_later(self.lease)
        else:
            self.client.ops.release(self.lease)

    def __enter__(self) -> PrefixMatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _names(cache, infix: str | None) -> list[list[str]]:
    return [
        [kv_buffer_name(kind, layer, infix) for kind in cache.components]
        for layer in range(cache.num_layers)
    ]


def _block_layout(cache, heads: int) -> Layout:
    """One published block buffer: ``[head][token][head_dim]`` of one (layer, K/V)."""
    return Layout.contiguous(
        cache.dtype,
        (heads, cache.block_size, cache.head_dim),
        ("head", "token", "head_dim"),
        iterated=("head",),
        sharded="head",
    )


def _check_kv_cache(cache, block_size: int, heads: int, tp_rank: int, tp_size: int) -> None:
    if cache.block_size != block_size:
        raise LayoutMismatch(
            f"layout mismatch on block size: the prefix cache pages {block_size} tokens, the "
            f"engine cache {cache.block_size}"
        )
    if cache.local_heads != heads:
        raise LayoutMismatch(
            f"layout mismatch on KV heads: TP rank {tp_rank} of {tp_size} holds {heads} "
            f"heads, but its cache has {cache.local_heads}"
        )


def _packed_extent(raw, packed: str | None, where: dict[str, int]):
    """``(pool, offset, nbytes)`` of a block's packed buffer ``packed`` (publish_kv's buffers
    back to back in one, as the vLLM connector publishes them), or None: a block of named
    buffers."""
    if packed is None:
        return None
    if isinstance(raw, dict):
        ext = raw.get(packed)
        return None if ext is None else tuple(ext)
    j = where.get(packed)
    return None if j is None else (raw[0], raw[1 + 2 * j], raw[2 + 2 * j])


class KVPrefixMatch(PrefixMatch):
    """A :meth:`PrefixCache.match_kv` result: one read lease on ``num_blocks`` leading blocks
    of every shard in ``ranks`` (TP ranks of the ``source`` TP size). Load them with
    :meth:`load` before releasing; the views die with the lease. Asked with ``hold=False``,
    only the count: nothing to load."""

    def __init__(
        self,
        client: Client,
        reply: dict,
        block_size: int,
        asked_at: float,
        *,
        source: int,
        heads: int | None,
        ranks: list[int],
        plan: list[Piece],
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__(client, reply, block_size, asked_at)
        self.source_tp_size = source
        self.total_kv_heads = heads
        self.ranks = ranks
        self.plan = plan
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._full = self._count // len(ranks)  # blocks every needed shard holds

    @property
    def num_blocks(self) -> int:
        return self._full

    @property
    def num_tokens(self) -> int:
        return self._full * self.block_size

    def _check(self, cache, infix: str | None) -> Layout:
        meta = self.meta
        where = f"prefix blocks of TP size {self.source_tp_size}"
        if not isinstance(meta, dict) or meta.get(SHARD_META_TAG) != 1:
            raise LayoutMismatch(f"{where} were not published by publish_kv (no layout in meta)")
        for what, published, local in (
            ("TP size", meta["tp_size"], self.source_tp_size),
            ("total KV heads", meta["total_kv_heads"], self.total_kv_heads),
            ("layers", meta["num_layers"], cache.num_layers),
            (
                "K/V components (latent vs per-head cache)",
                meta["components"],
                list(cache.components),
            ),
            ("buffer infix", meta["infix"], infix),
        ):
            if published != local:
                raise LayoutMismatch(
                    f"layout mismatch on {what} ({where}): published {published!r}, local {local!r}"
                )
        stored = Layout.from_dict(meta["layout"])
        check_compatible(
            stored, _block_layout(cache, stored.size("head")), ("token", "head_dim"), what=where
        )
        return stored

    def _starts(self, count: int, names: list[str], nbytes: int) -> tuple[list, int | None]:
        """Where each of ``names`` lies in each of the first ``count`` matched keys, after
        checking every buffer is there and ``nbytes`` long: ``[(pool, [byte offset per
        name])]``, and the byte stride between consecutive buffers if it is the same
        everywhere (the broker lays a block's buffers out back to back), else None."""
        out = []
        where = {name: i for i, name in enumerate(self._names)}
        slots = [where.get(name) for name in names]  # position in a compact block list
        packed = (self.meta or {}).get("packed")  # one buffer holding every name, in order
        strides = set()
        for i in range(count):
            raw = self._raw[i]
            whole = _packed_extent(raw, packed, where)
            if (
                whole is None
                and isinstance(raw, dict)
                and len(raw) == 1
                and not next(iter(raw)).startswith("past_")
            ):
                # a packed block in a chain that starts with named ones (whose meta is the
                # one the reply carries): its one buffer, not a KV name, holds them all
                whole = tuple(next(iter(raw.values())))
            if whole is not None:
                pool, offset, size = whole
                if size != nbytes * len(names):
                    raise LayoutMismatch(
                        f"layout mismatch on buffer size of "
                        f"{packed or 'a packed block'}: {size} bytes, "
                        f"{nbytes * len(names)} expected"
                    )
                out.append((pool, [offset + k * nbytes for k in range(len(names))]))
                strides.add(nbytes)
                continue
            offsets, pools = [], set()
            for name, j in zip(names, slots, strict=True):
                if isinstance(raw, dict):
                    ext = raw.get(name)
                else:
                    ext = None if j is None else (raw[0], raw[1 + 2 * j], raw[2 + 2 * j])
                if ext is None:
                    raise LayoutMismatch(
                        f"layout mismatch on buffers: a matched block has no {name}"
                    )
                pool, offset, size = ext
                if size != nbytes:
                    raise LayoutMismatch(
                        f"layout mismatch on buffer size of {name}: {size} bytes, {nbytes} expected"
                    )
                pools.add(pool)
                offsets.append(offset)
            steps = {b - a for a, b in itertools.pairwise(offsets)}
            strides.add(steps.pop() if len(steps) == 1 and len(pools) == 1 else None)
            out.append((pool, offsets))
        stride = strides.pop() if len(strides) == 1 else None
        return out, stride if stride is not None and stride >= nbytes else None

    def load(
        self, cache, block_ids: Any, *, num_blocks: int | None = None, infix: str | None = None
    ) -> int:
        """Write this rank's heads of the first ``num_blocks`` matched blocks (default all)
        into ``cache`` (a :class:`kvbroker.kv.PagedKV`) at engine blocks ``block_ids``, bit
        for bit. Returns the number of copy operations: blocks × layers × contributing shards
        (K and V move in one copy when the block's buffers lie back to back, as the broker
        lays them out; × K/V otherwise) — never per token."""
        n = self._full if num_blocks is None else num_blocks
        if not 0 <= n <= self._full:
            raise BadRequest(f"load: num_blocks {n} outside [0, {self._full}] matched")
        if n == 0:
            return 0
        if self.lease is None:
            raise KVBrokerError(
                "this prefix match was asked with hold=False: it holds no "
                "lease and has no blocks to load; match with hold=True"
            )
        if self.released:
            raise KVBrokerError("the prefix match was released; its blocks are gone")
        check_infix(infix)
        mine = shard_heads(self.tp_rank, self.tp_size, self.total_kv_heads)
        _check_kv_cache(cache, self.block_size, len(mine), self.tp_rank, self.tp_size)
        stored = self._check(cache, infix)
        ids = _block_index(block_ids, n * self.block_size, cache.block_size, cache.num_blocks)
        flat = [name for row in _names(cache, infix) for name in row]  # (layer, K/V) order
        layers, kinds = cache.num_layers, len(cache.components)
        np = _np()
        int_dtype = cache.component(0, 0).dtype
        isz = int_dtype.itemsize
        # Where every (block, shard, buffer) lies, resolved and checked once, so the copy loop
        # below does nothing but copy.
        shards = len(self.ranks)
        starts, stride = self._starts(n * shards, flat, stored.nbytes)
        maps = {pool: self.client._mapping(pool).mm for pool, _ in starts}
        pieces = []  # (shard, byte offset of its head range in a buffer, heads, dst heads)
        for piece in self.plan:
            (offset, _) = stored.narrow("head", piece.src_head, piece.count).descriptors()[0]
            pieces.append(
                (
                    self.ranks.index(piece.prefill_rank),
                    offset,
                    piece.count,
                    slice(piece.dst_head, piece.dst_head + piece.count),
                )
            )
        bs, dim = self.block_size, cache.head_dim
        if stride is not None:
            # Buffers back to back: one strided view reaches a block's whole shard, [layer, K/V,
            # token, head, dim], and one copy per layer moves its K and V heads together.
            # Head-major on both sides, like the stored shard: numpy then copies whole head_dim
            # rows in order instead of interleaving heads from strided sources (see
            # kvbroker.kv._scatter), which matters once a copy fills only part of a row.
            # Whole contiguous rows of enough heads copy in destination order; otherwise
            # head-major like the stored shard (see kvbroker.kv._whole_rows).
            by_row = [c.transpose(1, 0, 2, 3, 4) for c in map(cache.layer, range(layers))]
            by_head = [c.transpose(0, 1, 3, 2, 4) for c in by_row]  # [block, kv, head, tok, dim]
            plans = []
            for shard, first, count, heads in pieces:
                if _whole_rows(cache.component(0, 0), count):  # [layer, kv, tok, head, dim]
                    plans.append(
                        (
                            shard,
                            first,
                            heads,
                            by_row,
                            (layers, kinds, bs, count, dim),
                            (kinds * stride, stride, dim * isz, bs * dim * isz, isz),
                        )
                    )
                else:  # [layer, kv, head, tok, dim]
                    plans.append(
                        (
                            shard,
                            first,
                            heads,
                            by_head,
                            (layers, kinds, count, bs, dim),
                            (kinds * stride, stride, bs * dim * isz, dim * isz, isz),
                        )
                    )
            sources = []  # (engine block, heads, whole rows, the shard's [layer, ...] view)
            for row in range(n):
                for shard, first, heads, canon, shape, steps in plans:
                    pool, offsets = starts[row * shards + shard]
                    src = np.ndarray(shape, int_dtype, maps[pool], offsets[0] + first, steps)
                    sources.append((ids[row], heads, canon is by_row, src))

            def load_layer(layer: int) -> None:
                rows, heads_ = by_row[layer], by_head[layer]
                for block, heads, whole_rows, src in sources:
                    if whole_rows:
                        rows[block][:, :, heads] = src[layer]
                    else:
                        heads_[block][:, heads] = src[layer]

            ops = n * len(plans) * layers
        else:

            def load_layer(layer: int) -> None:
                for c in range(kinds):
                    k = layer * kinds + c
                    comp = cache.component(layer, c)
                    for row in range(n):
                        dst = comp[ids[row]]  # [token, head, dim] of this engine block
                        for shard, first, count, heads in pieces:
                            pool, offsets = starts[row * shards + shard]
                            dst[:, heads] = np.ndarray(
                                (bs, count, dim),
                                int_dtype,
                                maps[pool],
                                offsets[k] + first,
                                (dim * isz, bs * dim * isz, isz),
                            )

            ops = n * layers * kinds * len(pieces)
        # One job per layer over the copy engine's threads: each writes its own layer's
        # blocks (whatever the block ids), in the order one thread would.
        moved = n * layers * kinds * bs * dim * isz * sum(p[2] for p in pieces)
        default_engine().run_jobs(
            [functools.partial(load_layer, layer) for layer in range(layers)], moved
        )
        return ops
