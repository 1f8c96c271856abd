"""Sharded publish and claim of a request's KV between P prefill and D decode TP ranks.

Who owns what
-------------

- The engine owns its paged KV cache (:class:`PagedKV` wraps its tensors or arrays; kv.py
  keeps integer *views* of them, never copies). ``publish_shard`` only reads the given blocks;
  ``claim_shards`` only writes the given blocks, and only the decode rank's own heads.
- Each prefill rank publishes ONE broker object per request, ``{request}/tp{rank}of{P}``
  (:func:`shard_key`), holding one buffer per (layer, K/V) named ``past_key.{i}[_{infix}]`` /
  ``past_value.{i}[_{infix}]`` (``past_latent.{i}`` for MLA). Each buffer is laid out
  ``[head][token][head_dim]`` — the shard as a whole is ``[layer][kv][head][token][head_dim]``
  (:func:`kvbroker.layout.shard_storage`) — so any head range of a (layer, K/V) is one
  contiguous run. The token axis holds exactly ``num_tokens`` tokens: storage does not depend
  on the block size, so prefill and decode may page with different block sizes.
- The broker owns the object. It is freed after every decode rank that reads it has claimed
  it: the prefill rank sets ``consumers`` to that number, computed from (H, P, D) by
  :func:`kvbroker._client.tp.readers_of`. If the prefill rank does not know the decode TP size
  (``decode_tp_size=None``), the shard is published with the maximum count, so consume-claims
  never free it and eviction (LRU under pressure, ``kvbroker evict``) does. A shard nobody
  reads (an unused replica, when D is known) is not published at all.
- The meta of each object carries the storage layout, the engine's layout (for operators),
  the TP facts and ``num_tokens``; a claimer checks them and raises
  :class:`~kvbroker.errors.LayoutMismatch` naming the field rather than copying garbage.

Claim
-----

A decode rank needs ``shard_D(d)``; :func:`kvbroker._client.tp.claim_plan` says which prefill shards
hold those heads (one copy per head when heads are replicated; for MLA, the copy of prefill
rank ``d mod P``). The claim first *pins* every contributing shard with a consume claim
(a plain read lease when ``consume=False``), waiting at most ``wait`` seconds in total for
them to be sealed. If some are still missing it ends the pins uncounted
(``release(consume=False)``) and raises :class:`~kvbroker.errors.NotFound` (no shard of the
request is published: unknown request) or :class:`~kvbroker.errors.Incomplete` (naming the
missing shards); nothing was consumed, so a retry can succeed. Then it copies, straight from
the pool mapping into the decode cache's blocks. Only once every copy succeeded are the pins
released counted — one round trip per shard in all, the release pipelined; a mismatch or an
error mid-copy ends them uncounted, and a decode rank that crashes mid-claim loses its
connection, which ends its leases uncounted too. Either way nothing is consumed.

Copies are bit-exact: bytes move through unsigned integer views of the same item size
(bf16/fp16 as 16-bit ints, fp8 as bytes), never through float arithmetic. A claim issues, per
contributing shard and per (layer, K/V), one scatter of the whole blocks and one of the
partial last block if ``num_tokens`` is not a multiple of the decode block size — so
``ClaimResult.copy_ops <= 2 × layers × components × shards``, independent of the token count.
A copy that fills whole NHD rows of >= 2 KiB runs in row order; one that fills part of a row
(several shards feed each row) or an HND cache runs head-major, like the source: numpy is
1.5-2.5x slower interleaving a row's heads from strided sources. The shards of one (layer,
K/V) are copied back to back, while that destination is still in cache. (Copying K and V in
one strided view halves the calls but measured ~7 % slower for partial rows: not done.)

Torch is never imported here: a tensor argument means the caller already imported it, and
CPU tensors are viewed as numpy arrays of integers (zero-copy). Device tensors go through the
GPU staging path, not this host path (:func:`kvbroker.gpu.publish_shard_cuda`,
:func:`kvbroker.gpu.claim_shards_cuda`: same objects, Triton gather/scatter, bulk DMA).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from ._client.client import Client
from ._client import integrity as _integrity
from ._client.copy import _np, copy_into, nbytes_of
from ._client.engine import default_engine
from ._client.paged import PagedKV, _as_index, _block_index, _gather, _scatter, _split_view
from ._client.shards import UNKNOWN_CONSUMERS, ClaimResult, PublishResult, ShardSpec
from ._client.shards import META_TAG  # noqa: F401  (the meta key marking a shard)
from ._client.shards import SELECT_NOTHING
from ._client.shards import consumers_of, needed_shards, own_heads, pinned_shards, shard_key
from ._client.shards import agreed_tokens
from ._wire.names import check_infix, kv_buffer_name, kv_select_regex
from .errors import BadRequest, LayoutMismatch

__all__ = [
    "PagedKV",
    "PublishResult",
    "ClaimResult",
    "shard_key",
    "publish_shard",
    "claim_shards",
    "UNKNOWN_CONSUMERS",
    # buffer naming, for engines that claim a request's KV buffers themselves
    "SELECT_NOTHING",
    "kv_buffer_name",
    "kv_select_regex",
]


def publish_shard(
    client: Client,
    request: str,
    cache: PagedKV,
    block_ids: Any,
    num_tokens: int,
    *,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int | None,
    decode_tp_size: int | None = None,
    namespace: str = "default",
    infix: str | None = None,
    extra: Mapping[str, Any] | None = None,
    ttl: float | None = None,
    replace: bool = False,
) -> PublishResult:
    """Publish prefill rank ``tp_rank``'s shard of tokens ``[0, num_tokens)`` of ``request``.

    ``cache`` holds this rank's heads, ``shard_heads(tp_rank, tp_size, total_kv_heads)``
    (``total_kv_heads`` from the model config; ignored for latent caches). ``block_ids``:
    the blocks holding the request's tokens, in order. ``extra``: non-KV buffers (e.g.
    ``vision_embeds``) published alongside, names untouched.
    """
    started = time.perf_counter()
    check_infix(infix)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise BadRequest(f"num_tokens must be a positive int, not {num_tokens!r}")
    heads = None if cache.latent else total_kv_heads
    if not cache.latent and heads is None:
        raise BadRequest("total_kv_heads (from the model config) is required for a per-head cache")
    mine = own_heads(tp_rank, tp_size, heads, cache.local_heads, claiming=False)
    key = shard_key(request, tp_rank, tp_size)
    consumers = consumers_of(tp_rank, heads, tp_size, decode_tp_size)
    if consumers == 0:
        return PublishResult(key, False, 0, seconds=time.perf_counter() - started)
    ids = _block_index(block_ids, num_tokens, cache.block_size, cache.num_blocks)
    spec = ShardSpec.build(
        request,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=heads,
        heads=mine,
        num_tokens=num_tokens,
        num_layers=cache.num_layers,
        components=cache.components,
        dtype=cache.dtype,
        head_dim=cache.head_dim,
        infix=infix,
        engine_layout=cache.layouts[0],
        decode_tp_size=decode_tp_size,
    )
    names = spec.buffer_names()
    sizes = {name: spec.layout.nbytes for row in names for name in row}
    extra = dict(extra or {})
    for name in extra:
        if name in sizes:
            raise BadRequest(f"extra buffer {name!r} collides with a KV buffer name")
        sizes[name] = nbytes_of(extra[name])
    ops = 0
    with client.reserve(
        key,
        sizes,
        namespace=namespace,
        meta=spec.to_meta(),
        ttl=ttl,
        replace=replace,
        consumers=consumers,
    ) as lease:
        # One job per (layer, K/V) buffer over the copy engine's threads: each gathers its
        # blocks into the buffer, then hashes it while it is still in cache, so the seal
        # does not read every buffer again (kvbroker._client.engine.run_jobs).
        kind = client.checksum_kind if lease.checksum else None
        views = {name: lease[name] for row in names for name in row}
        shape = (len(mine), num_tokens, cache.head_dim)

        def gather(layer: int, c: int, name: str) -> tuple[int, Any]:
            n = _gather(
                cache.component(layer, c),
                ids,
                num_tokens,
                _split_view(views[name].view(cache.layer(0).dtype), shape),
            )
            return n, None if kind is None else _integrity.digest_here(views[name], kind)

        jobs = [
            functools.partial(gather, layer, c, name)
            for layer, row in enumerate(names)
            for c, name in enumerate(row)
        ]
        done = default_engine().run_jobs(jobs, spec.layout.nbytes * len(jobs))
        ops = sum(n for n, _ in done)
        sums = {
            name: d for (_, d), name in zip(done, (n for row in names for n in row), strict=True)
        }
        for name, value in extra.items():
            if not sizes[name]:
                if kind is not None:
                    sums[name] = _integrity.empty_digest(kind)
                continue
            if kind is None:
                copy_into(lease[name], value)
            else:  # hashed as it is copied: the bytes cross memory once, as in put
                sums[name] = _integrity.copy_hashed(lease[name], value, copy_into, kind)
            ops += 1
        if kind is not None:
            lease.checksums = sums
    return PublishResult(
        key, True, consumers, ops, sum(sizes.values()), time.perf_counter() - started
    )


def claim_shards(
    client: Client,
    request: str,
    cache: PagedKV,
    block_ids: Any,
    *,
    tp_rank: int,
    tp_size: int,
    prefill_tp_size: int,
    total_kv_heads: int | None,
    num_tokens: int | None = None,
    namespace: str = "default",
    infix: str | None = None,
    wait: float | None = None,
    consume: bool = True,
) -> ClaimResult:
    """Assemble decode rank ``tp_rank``'s heads of ``request`` into ``cache`` at ``block_ids``.

    ``wait``: seconds, in all, to wait for the needed shards to be sealed (None: do not wait).
    Raises NotFound (no needed shard published), Incomplete (some missing), LayoutMismatch.
    ``consume``: count this rank's claim towards freeing each shard read (see module doc).
    """
    started = time.perf_counter()
    check_infix(infix)
    heads = None if cache.latent else total_kv_heads
    if not cache.latent and heads is None:
        raise BadRequest("total_kv_heads (from the model config) is required for a per-head cache")
    own_heads(tp_rank, tp_size, heads, cache.local_heads, claiming=True)
    plan, keys = needed_shards(request, heads, prefill_tp_size, tp_size, tp_rank)
    # The pin maps every buffer (select None): a lease holds the whole object anyway, the KV
    # names are looked up by name below, and a KV select regex costs the daemon one regex
    # match per buffer (~2.5 µs each under RE2: a third of a ms for 64 layers).
    # Leaving the block releases the pins: counted once every copy landed; uncounted after a
    # mismatch or an error mid-copy, so nothing is consumed.
    with pinned_shards(client, request, keys, namespace, wait, consume) as pins:
        result = ClaimResult(keys, pieces=plan, wait_seconds=time.perf_counter() - started)
        specs = {}
        for key in keys:
            specs[key] = spec = ShardSpec.from_meta(pins[key].meta, key)
            spec.check(
                key,
                components=cache.components,
                num_layers=cache.num_layers,
                total_kv_heads=heads,
                tp_size=prefill_tp_size,
                infix=infix,
                layout=cache.layouts[0],
            )
        total = agreed_tokens(specs, num_tokens)
        ids = _block_index(block_ids, total, cache.block_size, cache.num_blocks)
        full_index = _as_index(ids[: total // cache.block_size])
        names = specs[keys[0]].buffer_names()
        int_dtype = cache.layer(0).dtype
        # Every piece's source run per (layer, K/V), checked before the first byte moves.
        sources = []
        for piece in plan:
            key = shard_key(request, piece.prefill_rank, prefill_tp_size)
            stored = specs[key].layout
            # One contiguous run per (layer, K/V): heads are outermost in a stored buffer.
            (run,) = stored.narrow("head", piece.src_head, piece.count).descriptors()
            extents = pins[key].extents()
            missing = [n for row in names for n in row if n not in extents]
            if missing:
                raise LayoutMismatch(f"layout mismatch on buffers: {key} has no {missing[0]}")
            if any(extents[n][2] != stored.nbytes for row in names for n in row):
                raise LayoutMismatch(
                    f"layout mismatch on buffer sizes: {key} does not hold "
                    f"{stored.nbytes} bytes per buffer"
                )
            sources.append((piece, extents, run))
        # Read-only use of the pinned pool bytes, viewed straight from the mapping: one
        # constructor call per copy instead of view + slice + reshape.
        np = _np()
        maps = {e[0]: client.pool_view(e[0]) for _, ext, _ in sources for e in ext.values()}
        dim = cache.head_dim

        # (layer, K/V) outermost, shards innermost: the pieces of one destination component
        # land back to back while its cache lines are still hot (an NHD row is written by
        # every contributing shard; shard-outermost order went to DRAM once per shard).
        # One job per (layer, K/V) over the copy engine's threads (each writes its own
        # component of the cache; kvbroker._client.engine.run_jobs).
        def scatter(layer: int, c: int, name: str) -> int:
            dst, ops = cache.component(layer, c), 0
            for piece, ext, (offset, _) in sources:
                pool, start, _ = ext[name]
                src = np.ndarray((piece.count, total, dim), int_dtype, maps[pool], start + offset)
                ops += _scatter(src, dst, ids, full_index, total, piece.dst_head)
            return ops

        jobs = [
            functools.partial(scatter, layer, c, name)
            for layer, row in enumerate(names)
            for c, name in enumerate(row)
        ]
        per_job = sum(nbytes for _, _, (_, nbytes) in sources)
        result.copy_ops += sum(default_engine().run_jobs(jobs, per_job * len(jobs)))
        result.source_runs += len(sources) * len(jobs)
        result.nbytes += per_job * len(jobs)
        result.num_tokens = total
    result.seconds = time.perf_counter() - started
    return result
