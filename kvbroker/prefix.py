"""Prefix KV reuse across data-parallel ranks: chained block hashes, longest-prefix match.

An engine's KV is published in blocks of ``block_size`` tokens. Block ``i`` is keyed by a
chained hash ``h_i = H(h_{i-1}, tokens of block i, namespace, cache_salt)`` (BLAKE2b, stable
across processes and Python runs), so a key names the whole prefix up to that block, and a
prefix never matches across namespaces or cache salts: tenants do not share prompts.

Ownership
---------
- :meth:`PrefixCache.publish` reserves every missing block in one round trip, copies each
  byte once, and seals them in a second; blocks already published cost no copy.
- :meth:`PrefixCache.match` returns a :class:`PrefixMatch`: one read lease covering every
  matched block (one round trip for all of them). Its views stay valid until ``release`` (the end of
  the ``with`` block): copy what you need into your own cache first. While held, the blocks
  are never evicted — many DP ranks may hold the same blocks at once.
- The broker evicts a chain from its leaf: a block goes only after every block that extends it.

Tensor parallelism
------------------
With ``PrefixCache(..., tp_rank=r, tp_size=T, total_kv_heads=H)`` each TP rank publishes and
matches its own head shard, ``shard_heads(r, T, H)``. A block's key is its chained hash plus
the shard, ``{h_i}/h{H}.tp{r}of{T}`` (:func:`shard_block_key`), and its parent is the previous
block of the *same* shard, so ranks never collide and each shard is a chain of its own,
evicted leaf first like any other. The hash itself does not depend on the layout: a DP rank
with another TP size computes the same ``h_i`` and reads another layout's shards.

- :meth:`PrefixCache.publish_kv` copies this rank's heads of every full block out of the
  engine's paged cache (:class:`kvbroker.kv.PagedKV`) into buffers ``past_key.{l}`` /
  ``past_value.{l}`` (``past_latent.{l}`` for MLA) laid out ``[head][token][head_dim]``, so
  any head range of a block's (layer, K/V) is one contiguous run. Blocks the node holds cost
  nothing; each new byte is copied once.
- :meth:`PrefixCache.match_kv` asks, in one round trip, for the blocks of exactly the shards
  this rank's heads come from (:func:`kvbroker._client.tp.claim_plan`): with the same TP size that is
  the shard of the same TP rank; with another TP size it is every contributing shard of that
  layout (``source_tp_size``, or this rank's own TP size and then ``peer_tp_sizes``, longest
  match wins). The match length is the run of leading blocks that *every* needed shard holds,
  never more (one TP rank's shard evicted early shortens everybody's match). The returned
  :class:`KVPrefixMatch` holds one read lease over those blocks; :meth:`KVPrefixMatch.load`
  writes this rank's heads into its paged cache at the given block ids, bit for bit: per
  matched block, one copy per (layer, contributing shard), K and V together, never per token.
- The TP ranks of one DP rank each run their own match, and may see different lengths when
  blocks are published or evicted in between: agree on the minimum (the engine's scheduler
  usually matches once per DP rank) and pass it as ``load(..., num_blocks=)``.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._client import integrity as _integrity
from ._client.client import Client, WriteLease
from ._client.copy import _np, copy_into, nbytes_of
from ._wire.names import check_infix, kv_buffer_name
from ._client.tp import Piece, claim_plan, shard_heads
from .errors import BadRequest, KVBrokerError, LayoutMismatch
from .layout import Layout, check_compatible

__all__ = ["KVPrefixMatch", "PrefixCache", "PrefixMatch", "block_hashes", "shard_block_key"]

SHARD_META_TAG = "kvbroker.prefix.kv"  # meta key marking (and versioning) a publish_kv block

_DIGEST = 16


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    namespace: str = "default",
    cache_salt: str = "",
) -> list[str]:
    """Chained hashes of every *full* block of ``token_ids`` (hex strings)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    seed = hashlib.blake2b(digest_size=_DIGEST, person=b"kvbroker-prefix")
    seed.update(len(namespace).to_bytes(4, "little") + namespace.encode())
    seed.update(len(cache_salt).to_bytes(4, "little") + cache_salt.encode())
    prev = seed.digest()
    out = []
    n_full = len(token_ids) // block_size
    # Tokens as little-endian int64, converted once: per-token Python would dominate.
    raw = memoryview(_token_bytes(token_ids[: n_full * block_size]))
    step = 8 * block_size
    blake2b = hashlib.blake2b
    for b in range(n_full):
        h = blake2b(prev, digest_size=_DIGEST)
        h.update(raw[b * step : (b + 1) * step])
        prev = h.digest()
        out.append(prev.hex())
    return out


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    import numpy as np

    return np.asarray(token_ids, dtype="<i8").tobytes()


def shard_block_key(block_hash: str, tp_rank: int, tp_size: int, total_kv_heads: int | None) -> str:
    """The key of TP rank ``tp_rank`` of ``tp_size``'s shard of the block ``block_hash``.

    ``total_kv_heads`` None (an MLA latent cache: every rank holds the same bytes) names the
    shard ``h0``."""
    return f"{block_hash}/h{total_kv_heads or 0}.tp{tp_rank}of{tp_size}"


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
        view = _np().frombuffer(self._match.client._mapping(pool).mm, dtype="uint8",
                                count=nbytes, offset=offset)  # fmt: skip
        view.flags.writeable = False
        return view

    def __iter__(self):
        return iter(self._extents)

    def keys(self):
        return self._extents.keys()


class PrefixMatch:
    """One read lease on the longest published prefix; release it once copied."""

    def __init__(self, client: Client, reply: dict, block_size: int, asked_at: float) -> None:
        self.client = client
        self.block_size = block_size
        self.lease: int | None = reply["lease"]
        self.ttl: float = reply["ttl"]
        self.meta: dict | None = (reply.get("metas") or [None])[0]
        names = reply["names"]
        self._names = names
        self._packed: bytes | None = reply.get("packed")
        if self._packed is not None:  # one int64 row per block, parsed on first use
            self._count = len(self._packed) // (8 * (1 + 2 * len(names)))
            self._rows: list | None = None
        else:
            self._rows = reply["blocks"]
            self._count = len(self._rows)
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

    @property
    def blocks(self) -> list[MatchedBlock]:
        if self._blocks is None:  # built on first use: a caller may only want the count
            out = []
            for raw in self._raw:
                if isinstance(raw, dict):
                    ext = {n: tuple(e) for n, e in raw.items()}
                else:
                    pool = raw[0]
                    ext = {n: (pool, raw[1 + 2 * i], raw[2 + 2 * i])
                           for i, n in enumerate(self._names)}  # fmt: skip
                out.append(MatchedBlock(self, ext))
            self._blocks = out
        return self._blocks

    @property
    def num_blocks(self) -> int:
        return self._count

    @property
    def num_tokens(self) -> int:
        return self._count * self.block_size

    def renew(self, ttl: float | None = None) -> None:
        if self.lease is not None:
            asked_at = time.monotonic()
            ((_, granted),) = self.client._call("renew", leases=[self.lease], ttl=ttl)["expires_in"]
            self._safe_until = asked_at + 0.9 * granted

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if time.monotonic() < self._safe_until:
            self.client._send_only("release", lease=self.lease)
        else:
            self.client._call("release", lease=self.lease)

    def __enter__(self) -> PrefixMatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PrefixCache:
    """A DP rank's view of the node's prefix cache for one namespace and cache salt.

    Unsharded (``total_kv_heads`` None, ``tp_size`` 1): a block's key is its chained hash and
    its buffers are whatever the engine publishes. Sharded: see "Tensor parallelism" above;
    ``peer_tp_sizes`` names the TP sizes of the other DP ranks sharing this node, tried by
    :meth:`match_kv` after this rank's own when that does not cover the prompt.
    """

    def __init__(
        self,
        client: Client,
        *,
        namespace: str = "prefix",
        block_size: int = 16,
        cache_salt: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int | None = None,
        peer_tp_sizes: Sequence[int] = (),
        checksum: bool = True,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise BadRequest(f"block_size must be a positive int, not {block_size!r}")
        shard_heads(tp_rank, tp_size, total_kv_heads)  # validates the TP facts
        for peer in peer_tp_sizes:
            shard_heads(0, peer, total_kv_heads)
        self.client = client
        self.namespace = namespace
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        self.peer_tp_sizes = tuple(peer_tp_sizes)
        # Like put: each block's buffers are hashed chunk by chunk as they are copied in, and
        # the digests are recorded at seal (claim(verify=True), `kvbroker verify`).
        self.checksum = checksum
        # Legacy unsharded keys are the bare hashes; publish_kv/match_kv always use shard keys.
        self.sharded = total_kv_heads is not None or tp_size != 1
        self._plans: dict[tuple, tuple] = {}  # (source TP size, heads) -> plan, ranks, key suffixes

    def hashes(self, token_ids: Sequence[int]) -> list[str]:
        return block_hashes(token_ids, self.block_size, namespace=self.namespace,
                            cache_salt=self.cache_salt)  # fmt: skip

    def keys(self, hashes: Sequence[str], *, tp_rank: int | None = None,
             tp_size: int | None = None) -> list[str]:  # fmt: skip
        """The broker keys of ``hashes`` for one shard (default: this rank's)."""
        if not self.sharded:
            return list(hashes)
        r = self.tp_rank if tp_rank is None else tp_rank
        t = self.tp_size if tp_size is None else tp_size
        suffix = shard_block_key("", r, t, self.total_kv_heads)
        return [h + suffix for h in hashes]

    def publish(
        self,
        token_ids: Sequence[int],
        blocks: Sequence[Mapping[str, Any]] | Callable[[int], Mapping[str, Any]],
        *,
        block_sizes: Mapping[str, int] | None = None,
        meta: dict | None = None,
    ) -> int:
        """Publish the full blocks of ``token_ids``; returns how many were new.

        ``blocks``: block ``i``'s buffers ({name: array/tensor/bytes}), as a sequence, or as
        a function of ``i`` together with ``block_sizes`` ({name: nbytes}, the same for every
        block): the function is then called only for blocks the node lacks, so nothing is
        gathered for blocks that are already there. A sharded cache publishes under this TP
        rank's shard keys; the bytes are the engine's business (use :meth:`publish_kv` for
        blocks other TP layouts can reshard).
        """
        return self._publish(self.keys(self.hashes(token_ids)), blocks, block_sizes, meta)

    def _publish(self, keys: list[str], blocks, block_sizes, meta) -> int:
        if not keys:
            return 0
        if callable(blocks):
            if block_sizes is None:
                raise TypeError("publish: a function of the block index needs block_sizes")
            get = blocks
            sizes = [dict(block_sizes)] * len(keys)
        else:
            if len(blocks) < len(keys):
                raise ValueError(f"publish: {len(keys)} full blocks but {len(blocks)} given")
            get = blocks.__getitem__
            sizes = [{name: nbytes_of(b) for name, b in blocks[i].items()}
                     for i in range(len(keys))]  # fmt: skip
        request = [
            {"key": k, "parent": keys[i - 1] if i else None, "buffers": sizes[i], "meta": meta}
            for i, k in enumerate(keys)
        ]
        reply = self.client._call("reserve_blocks", namespace=self.namespace, blocks=request)
        leases: list[int] = []
        sums: list[dict[str, int]] = []
        try:
            for i, res in enumerate(reply["results"]):
                if res.get("exists"):
                    continue
                lease = WriteLease(self.client, self.namespace, keys[i],
                                   {"lease": res["lease"], "ttl": reply["ttl"],
                                    "buffers": res["buffers"]})  # fmt: skip
                digests = {}
                for name, src in get(i).items():
                    if not sizes[i][name]:
                        digests[name] = _integrity.digest(b"")
                    elif self.checksum:
                        digests[name] = _integrity.copy_hashed(lease[name], src, copy_into)
                    else:
                        copy_into(lease[name], src)
                lease._drop_views()
                leases.append(lease.id)
                sums.append(digests)
        except BaseException:
            for res in reply["results"]:
                if "lease" in res:
                    try:
                        self.client._send_only("abort", lease=res["lease"])
                    except KVBrokerError:
                        break  # the connection is gone, and its leases with it
            raise
        if leases:
            try:
                self.client._call("seal_many", leases=leases,
                                  checksums=sums if self.checksum else None)  # fmt: skip
            except BadRequest:
                # Refused (e.g. a daemon requiring checksums): what was not sealed is aborted
                # now rather than held until its TTL.
                for lease_id in leases:
                    try:
                        self.client._call("abort", lease=lease_id)
                    except KVBrokerError:
                        pass  # sealed before the refusal, or already gone
                raise
        return len(leases)

    def match(
        self,
        token_ids: Sequence[int],
        *,
        hashes: list[str] | None = None,
        ttl: float | None = None,
    ) -> PrefixMatch:
        """One read lease on the longest run of leading blocks the node holds.

        Never more than ``len(token_ids) - 1`` tokens: the engine must prefill at least one
        token to get logits. ``hashes``: this prompt's block hashes if the engine already
        computed them (e.g. when the request arrived). A sharded cache matches this TP rank's
        own shard keys only (see :meth:`match_kv` for every shard this rank needs).
        """
        usable = max(0, len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = self.hashes(token_ids[: usable * self.block_size])
        keys = self.keys(hashes[:usable])
        asked_at = time.monotonic()
        reply = self.client._call("match_prefix", namespace=self.namespace, keys=keys,
                                  block_tokens=self.block_size, ttl=ttl)  # fmt: skip
        return PrefixMatch(self.client, reply, self.block_size, asked_at)

    # -- KV blocks that any TP layout can read -------------------------------------------------
    def _kv_heads(self, cache) -> int | None:
        if cache.latent:
            return None
        if self.total_kv_heads is None:
            raise BadRequest("publish_kv/match_kv of a per-head cache need total_kv_heads "
                             "(from the model config)")  # fmt: skip
        return self.total_kv_heads

    def publish_kv(self, token_ids: Sequence[int], cache, block_ids: Any, *,
                   infix: str | None = None) -> int:  # fmt: skip
        """Publish this TP rank's heads of every full block of ``token_ids``; returns how
        many blocks were new. ``cache``: a :class:`kvbroker.kv.PagedKV` whose block size is
        this cache's; ``block_ids``: the engine blocks holding the prompt, in order."""
        from ._client.paged import _block_index

        check_infix(infix)
        heads = self._kv_heads(cache)
        mine = shard_heads(self.tp_rank, self.tp_size, heads)
        _check_kv_cache(cache, self.block_size, len(mine), self.tp_rank, self.tp_size)
        n = len(token_ids) // self.block_size
        if n == 0:
            return 0
        ids = _block_index(block_ids, n * self.block_size, cache.block_size, cache.num_blocks)
        buffer = _block_layout(cache, len(mine))
        names = _names(cache, infix)
        sizes = {name: buffer.nbytes for row in names for name in row}
        meta = {
            SHARD_META_TAG: 1, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
            "total_kv_heads": heads, "heads": [mine.start, mine.stop],
            "num_layers": cache.num_layers, "components": list(cache.components),
            "infix": infix, "layout": buffer.to_dict(),
        }  # fmt: skip

        def block(i: int) -> dict:
            # [token, head, dim] of engine block ids[i] seen as [head, token, dim]: copy_into
            # walks the strides while writing the pool, so each byte moves once.
            return {name: cache.component(layer, c)[ids[i]].transpose(1, 0, 2)
                    for layer, row in enumerate(names) for c, name in enumerate(row)}  # fmt: skip

        suffix = shard_block_key("", self.tp_rank, self.tp_size, heads)
        keys = [h + suffix for h in self.hashes(token_ids[: n * self.block_size])]
        return self._publish(keys, block, sizes, meta)

    def match_kv(
        self,
        token_ids: Sequence[int],
        *,
        source_tp_size: int | None = None,
        hashes: list[str] | None = None,
        ttl: float | None = None,
        latent: bool = False,
    ) -> KVPrefixMatch:
        """The longest prefix every shard this rank needs holds, under one read lease.

        ``source_tp_size``: the TP size of the layout to read; None tries this rank's own,
        then ``peer_tp_sizes``, and keeps the longest match (one round trip each, stopping at
        the first that covers every usable block). ``latent``: the engine cache is an MLA
        latent cache (no head axis). Never more than ``len(token_ids) - 1`` tokens.
        """
        usable = max(0, len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = self.hashes(token_ids[: usable * self.block_size])
        hashes = hashes[:usable]
        heads = None if latent else self.total_kv_heads
        if heads is None and not latent:
            raise BadRequest("match_kv of a per-head cache needs total_kv_heads")
        if source_tp_size is not None:
            sizes = [source_tp_size]
        else:
            sizes = [self.tp_size, *self.peer_tp_sizes]
        best: KVPrefixMatch | None = None
        try:
            for source in dict.fromkeys(sizes):
                found = self._match_layout(hashes, source, heads, ttl)
                if best is None or found.num_blocks > best.num_blocks:
                    if best is not None:
                        best.release()
                    best = found
                else:
                    found.release()
                if best.num_blocks == len(hashes):
                    break
        except BaseException:
            if best is not None:
                best.release()  # not held until its TTL because a later layout's match failed
            raise
        assert best is not None
        return best

    def _match_layout(self, hashes: list[str], source: int, heads: int | None,
                      ttl: float | None) -> KVPrefixMatch:  # fmt: skip
        cached = self._plans.get((source, heads))
        if cached is None:  # the same few layouts, match after match
            plan = claim_plan(heads, source, self.tp_size, self.tp_rank)
            ranks = list(dict.fromkeys(p.prefill_rank for p in plan))
            suffixes = [shard_block_key("", r, source, heads) for r in ranks]
            cached = self._plans[source, heads] = (plan, ranks, suffixes)
        plan, ranks, suffixes = cached
        # Block-major, shard-minor: the broker's longest run of present keys, divided by the
        # shard count, is the run of blocks every needed shard holds. A partial last row is
        # pinned by the same lease and ignored.
        if len(suffixes) == 1:
            keys = [h + suffixes[0] for h in hashes]
        else:
            keys = [h + suffix for h in hashes for suffix in suffixes]
        asked_at = time.monotonic()
        # The broker counts hit tokens per key found: a key is 1/len(ranks) of a block here.
        reply = self.client._call("match_prefix", namespace=self.namespace, keys=keys,
                                  block_tokens=self.block_size // len(ranks), ttl=ttl)  # fmt: skip
        return KVPrefixMatch(self.client, reply, self.block_size, asked_at, source=source,
                             heads=heads, ranks=ranks, plan=plan, tp_rank=self.tp_rank,
                             tp_size=self.tp_size)  # fmt: skip


def _names(cache, infix: str | None) -> list[list[str]]:
    return [[kv_buffer_name(kind, layer, infix) for kind in cache.components]
            for layer in range(cache.num_layers)]  # fmt: skip


def _block_layout(cache, heads: int) -> Layout:
    """One published block buffer: ``[head][token][head_dim]`` of one (layer, K/V)."""
    return Layout.contiguous(cache.dtype, (heads, cache.block_size, cache.head_dim),
                             ("head", "token", "head_dim"), iterated=("head",),
                             sharded="head")  # fmt: skip


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


class KVPrefixMatch(PrefixMatch):
    """A :meth:`PrefixCache.match_kv` result: one read lease on ``num_blocks`` leading blocks
    of every shard in ``ranks`` (TP ranks of the ``source`` TP size). Load them with
    :meth:`load` before releasing; the views die with the lease."""

    def __init__(self, client: Client, reply: dict, block_size: int, asked_at: float, *,
                 source: int, heads: int | None, ranks: list[int], plan: list[Piece],
                 tp_rank: int, tp_size: int) -> None:  # fmt: skip
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
            ("K/V components (latent vs per-head cache)", meta["components"],
             list(cache.components)),
            ("buffer infix", meta["infix"], infix),
        ):  # fmt: skip
            if published != local:
                raise LayoutMismatch(f"layout mismatch on {what} ({where}): published "
                                     f"{published!r}, local {local!r}")  # fmt: skip
        stored = Layout.from_dict(meta["layout"])
        check_compatible(stored, _block_layout(cache, stored.size("head")),
                         ("token", "head_dim"), what=where)  # fmt: skip
        return stored

    def _starts(self, count: int, names: list[str], nbytes: int) -> tuple[list, int | None]:
        """Where each of ``names`` lies in each of the first ``count`` matched keys, after
        checking every buffer is there and ``nbytes`` long: ``[(pool, [byte offset per
        name])]``, and the byte stride between consecutive buffers if it is the same
        everywhere (the broker lays a block's buffers out back to back), else None."""
        out = []
        where = {name: i for i, name in enumerate(self._names)}
        slots = [where.get(name) for name in names]  # position in a compact block list
        strides = set()
        for i in range(count):
            raw = self._raw[i]
            offsets, pools = [], set()
            for name, j in zip(names, slots):
                if isinstance(raw, dict):
                    ext = raw.get(name)
                else:
                    ext = None if j is None else (raw[0], raw[1 + 2 * j], raw[2 + 2 * j])
                if ext is None:
                    raise LayoutMismatch(f"layout mismatch on buffers: a matched block has no "
                                         f"{name}")  # fmt: skip
                pool, offset, size = ext
                if size != nbytes:
                    raise LayoutMismatch(f"layout mismatch on buffer size of {name}: {size} "
                                         f"bytes, {nbytes} expected")  # fmt: skip
                pools.add(pool)
                offsets.append(offset)
            steps = {b - a for a, b in itertools.pairwise(offsets)}
            strides.add(steps.pop() if len(steps) == 1 and len(pools) == 1 else None)
            out.append((pool, offsets))
        stride = strides.pop() if len(strides) == 1 else None
        return out, stride if stride is not None and stride >= nbytes else None

    def load(self, cache, block_ids: Any, *, num_blocks: int | None = None,
             infix: str | None = None) -> int:  # fmt: skip
        """Write this rank's heads of the first ``num_blocks`` matched blocks (default all)
        into ``cache`` (a :class:`kvbroker.kv.PagedKV`) at engine blocks ``block_ids``, bit
        for bit. Returns the number of copy operations: blocks × layers × contributing shards
        (K and V move in one copy when the block's buffers lie back to back, as the broker
        lays them out; × K/V otherwise) — never per token."""
        from ._client.paged import _block_index, _whole_rows

        n = self._full if num_blocks is None else num_blocks
        if not 0 <= n <= self._full:
            raise BadRequest(f"load: num_blocks {n} outside [0, {self._full}] matched")
        if n == 0:
            return 0
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
            pieces.append((self.ranks.index(piece.prefill_rank), offset, piece.count,
                           slice(piece.dst_head, piece.dst_head + piece.count)))  # fmt: skip
        bs, dim = self.block_size, cache.head_dim
        ops = 0
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
                    plans.append((shard, first, heads, by_row, (layers, kinds, bs, count, dim),
                                  (kinds * stride, stride, dim * isz, bs * dim * isz, isz)))
                else:  # [layer, kv, head, tok, dim]
                    plans.append((shard, first, heads, by_head, (layers, kinds, count, bs, dim),
                                  (kinds * stride, stride, bs * dim * isz, dim * isz, isz)))
            for row in range(n):
                block = ids[row]
                for shard, first, heads, canon, shape, steps in plans:
                    pool, offsets = starts[row * shards + shard]
                    src = np.ndarray(shape, int_dtype, maps[pool], offsets[0] + first, steps)
                    if canon is by_row:
                        for layer in range(layers):
                            canon[layer][block][:, :, heads] = src[layer]
                    else:
                        for layer in range(layers):
                            canon[layer][block][:, heads] = src[layer]
                    ops += layers
            return ops
        comps = [cache.component(layer, c) for layer in range(layers) for c in range(kinds)]
        for row in range(n):
            block = ids[row]
            for k, comp in enumerate(comps):
                dst = comp[block]  # [token, head, dim] of this engine block
                for shard, first, count, heads in pieces:
                    pool, offsets = starts[row * shards + shard]
                    src = np.ndarray((bs, count, dim), int_dtype, maps[pool], offsets[k] + first,
                                     (dim * isz, bs * dim * isz, isz))  # fmt: skip
                    dst[:, heads] = src
                    ops += 1
        return ops
