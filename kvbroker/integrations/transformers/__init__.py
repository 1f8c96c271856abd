"""Hugging Face transformers adapter: a model's KV ``Cache`` through the broker and back.

``model(input_ids, use_cache=True).past_key_values`` is a ``DynamicCache``: one layer object
per decoder layer, each holding ``keys`` and ``values`` tensors ``[batch, kv_heads, seq,
head_dim]``. This module publishes those tensors and rebuilds a ``DynamicCache`` from a claim,
for any decoder-only architecture whose layers are full attention (``DynamicLayer``) or
sliding-window attention (``DynamicSlidingWindowLayer``): Llama, Qwen2, Mistral, GPT-NeoX,
Phi, Gemma... with the model's real head counts (GQA/MQA included) and any dtype (bf16, fp16,
fp32, ...). Bytes move through integer views of the same item size, never through float
arithmetic, so a rebuilt cache is bit-identical to the published one.

Three ways through the broker:

- **Under a request key** (:func:`publish_cache` / :func:`claim_cache`): one object, buffers
  ``past_key.{i}`` / ``past_value.{i}`` holding layer ``i``'s tensors as they are
  (``[batch][head][token][head_dim]``), meta with the model facts (:class:`KVSpec`: layers,
  KV heads, head_dim, dtype), ``seq_len``, the tokens each layer holds, and the caller's own
  ``extra`` meta (e.g. the first sampled token).
- **As head shards for heterogeneous TP** (:func:`publish_tp_shard` / :func:`claim_tp_shard`,
  through :mod:`kvbroker.kv`): prefill rank ``p`` of ``P`` publishes the heads it holds, decode
  rank ``d`` of ``D`` claims exactly its own heads. :func:`head_shard` and
  :func:`merge_head_shards` emulate TP ranks in one process (tests, examples).
- **As prefix blocks** (:func:`publish_prefix` / :func:`claim_prefix`, through
  :class:`kvbroker.prefix.PrefixCache`): full blocks of ``block_size`` tokens keyed by chained
  token hashes, so another DP rank sharing a system prompt prefills only its suffix.

A claimer states what its model expects (``config`` + ``dtype``, or ``model``); a published
cache that differs in layers, KV heads, head_dim, dtype or sliding window raises
:class:`~kvbroker.errors.LayoutMismatch` naming the field, and nothing is consumed.

Who owns each buffer, and who frees it
--------------------------------------

- **End of prefill** (``publish_*``): the engine keeps owning its ``Cache`` and every tensor
  in it; publishing only reads them. Each byte is copied once, straight from the cache
  tensors (CPU or CUDA) into the broker's pool; when the call returns, the broker owns the
  object (sealed) and the engine may free, reuse or keep extending its cache at once.
  :func:`publish_tp_shard` is the exception to "once": ``kvbroker.kv`` takes one tensor per
  layer with a K/V axis while transformers keeps K and V in separate tensors, so the shard is
  first gathered into a host staging tensor that the call allocates and drops on return.
- **Start of decode** (``claim_*``): the call allocates fresh tensors (on ``device``), copies
  the published bytes into them once, and returns a ``DynamicCache`` that owns them: the
  engine owns the cache from then on, and the model's next forward extends it as usual
  (:func:`claim_tp_shard` fills a host tensor through ``kvbroker.kv``'s host path, then moves
  it to a non-CPU ``device``: one copy more there). The
  broker's read lease ends inside the call; with ``consume=True`` (the default) the claim
  counts towards freeing the object (``consumers`` set at publish) only after every copy
  succeeded, so a failed or mismatched claim consumes nothing and can be retried. The
  exception: :func:`claim_cache` onto a CUDA device through a ``GpuClient`` returns once the
  copies are queued (``overlap``): the lease then belongs to ``ClaimedCache.landing``, the
  GpuClient's finisher thread releases it (and counts the consume) once they have landed,
  and each layer's tensors make their reader's stream wait for that layer's copies.
  :func:`claim_prefix` never consumes: prefix blocks are shared, the broker evicts them.
- **Request abort**: an exception inside ``publish_*`` aborts the write lease (nothing is left
  on the node). A request aborted after publication and before its claim is dropped with
  :func:`discard`, which evicts its object and its TP shards; an object nobody claims is also
  reclaimed by eviction (LRU under pressure, ``kvbroker evict``). A claimed cache is the
  engine's: dropping the ``DynamicCache`` frees it.

``import kvbroker.integrations.transformers`` imports neither torch nor transformers; they are
imported on first use, by the functions that handle tensors.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ... import Client
from ...blocks import claim_plan, copy_into, shard_heads
from ...errors import BadRequest, Exists, KVBrokerError, LayoutMismatch
from ...kv import SELECT_NOTHING  # a claim selecting no buffer: it only counts a consume
from ...kv import PagedKV, PublishResult, claim_shards, publish_shard, shard_key
from ...kv import kv_select_regex
from ._spec import (  # noqa: F401  (copy_into, KVSpec... stay importable from here)
    KVSpec,
    _build_cache,
    _check_size,
    _copy_from_pool,
    _copy_source,
    _dtype_name,
    _ints,
    _Layer,
    _local_spec,
    _np_copyto,
    _read_layers,
    _spec_of,
    _torch,
    _torch_dtype,
)
from ._landing import LateLanding, guard_layers
from ._prefix import claim_prefix, publish_prefix
from ._spec import META_TAG, ClaimedCache, PublishedCache, _buffer_names

__all__ = [
    "KVSpec",
    "PublishedCache",
    "ClaimedCache",
    "publish_cache",
    "claim_cache",
    "publish_tp_shard",
    "claim_tp_shard",
    "publish_prefix",
    "claim_prefix",
    "head_shard",
    "merge_head_shards",
    "discard",
]

log = logging.getLogger("kvbroker")
# One block holding every token: the whole sequence of a layer as kvbroker.kv's paged cache.
_STAGED_AXES = ("layer", "kv", "block", "head", "token", "head_dim")


# -- under a request key ---------------------------------------------------------------------


def publish_cache(
    client: Client,
    request: str,
    cache: Any,
    *,
    config: Any = None,
    namespace: str = "default",
    extra: Mapping[str, Any] | None = None,
    consumers: int = 1,
    ttl: float | None = None,
    replace: bool = False,
) -> PublishedCache:
    """Publish ``cache`` (a DynamicCache or (K, V) pairs) under ``request``, one copy per byte.

    ``config``: the model's config, checked against the cache and recorded (model_type).
    ``extra``: msgpack-able meta handed to the claimer (e.g. ``{"next_token": 42}``).
    ``consumers``: consume-claims that free the object (one per decode instance).
    ``client``: a Client, or a ``kvbroker.gpu.GpuClient`` for CUDA caches (DMA, see
    :func:`_broker_client`).
    """
    started = time.perf_counter()
    gpu, client = _gpu_of(client), _broker_client(client)
    layers = _read_layers(cache)
    spec = _spec_of(layers, config)
    meta = {
        META_TAG: 1,
        **spec.to_meta(),
        "batch": int(layers[0].keys.shape[0]),
        "seq_len": layers[0].seen,
        "layer_tokens": [layer.stored for layer in layers],
        "extra": dict(extra or {}),
    }
    names = _buffer_names(len(layers))
    tensors = {}
    for (kname, vname), layer in zip(names, layers, strict=True):
        tensors[kname], tensors[vname] = layer.keys, layer.values
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    if gpu is not None and all(
        t.is_cuda and n for t, n in zip(tensors.values(), sizes.values(), strict=True)
    ):
        # DMA into the pool and the checksums computed on the GPU beside it (GpuClient.publish):
        # the seal does not hash 2 GiB on one CPU core. A strided layer is made contiguous on
        # the device first (device memory; the host still sees each byte once).
        if not gpu.publish(
            request,
            {n: t.contiguous() for n, t in tensors.items()},
            namespace=namespace,
            meta=meta,
            replace=replace,
            ttl=ttl,
            consumers=consumers,
        ):
            raise Exists(f"{namespace}/{request} is already published")
        return PublishedCache(
            request, layers[0].seen, sum(sizes.values()), time.perf_counter() - started
        )
    with client.reserve(
        request,
        sizes,
        namespace=namespace,
        meta=meta,
        replace=replace,
        ttl=ttl,
        consumers=consumers,
    ) as lease:
        for name, t in tensors.items():
            if sizes[name]:
                copy_into(lease[name], _copy_source(t))  # strided or CUDA: still one pass
    return PublishedCache(
        request, layers[0].seen, sum(sizes.values()), time.perf_counter() - started
    )


def _gpu_of(client: Any):
    """The :class:`kvbroker.gpu.GpuClient` given, or None (no torch import for a Client)."""
    if isinstance(client, Client):
        return None
    from ...gpu import GpuClient

    return client if isinstance(client, GpuClient) else None


def _broker_client(client: Any) -> Client:
    """Accept a :class:`kvbroker.gpu.GpuClient` wherever a Client is taken: its pool mappings
    are CUDA-registered (once per process), so the copies below between the pool and CUDA
    tensors run as DMA at pinned-memory speed instead of through pageable staging."""
    from ...gpu import GpuClient  # no torch import at module level

    return client.client if isinstance(client, GpuClient) else client


def _consume(client: Client, key: str, namespace: str) -> None:
    """Count one consume-claim of ``key`` without mapping any buffer (frees it if last)."""
    client.claim(key, namespace=namespace, select=SELECT_NOTHING, consume=True).release()


def claim_cache(
    client: Client,
    request: str,
    *,
    model: Any = None,
    config: Any = None,
    dtype: Any = None,
    namespace: str = "default",
    wait: float | None = None,
    consume: bool = True,
    device: Any = None,
    overlap: bool | None = None,
) -> ClaimedCache:
    """Rebuild the DynamicCache published under ``request`` for ``model`` (or config + dtype).

    ``wait``: seconds to wait for the request to be sealed (NotFound / Timeout otherwise).
    ``device``: where the new tensors live (default CPU); bytes go straight from the pool.
    ``overlap`` (default: on for a CUDA ``device`` through a ``GpuClient``): return once the
    copies are queued, so the model's next forward runs while they land, each layer waiting
    on the GPU for its own copies only (``_landing``'s module doc). ``ClaimedCache.landing``
    then holds the lease until they are done; its ``finish()`` raises what failed after the
    return. False: copy everything, then return.
    """
    torch = _torch()
    started = time.perf_counter()
    gpu, client = _gpu_of(client), _broker_client(client)
    local, config = _local_spec(model, config, dtype)
    cuda = device is not None and torch.device(device).type == "cuda"
    if overlap and not (gpu is not None and cuda):
        raise BadRequest(
            "claim_cache(overlap=True) needs a CUDA device and a kvbroker.gpu."
            "GpuClient (its DMA lands while the model computes)"
        )
    overlapping = overlap is not False and gpu is not None and cuda
    lease = client.claim(request, namespace=namespace, select=kv_select_regex(), wait=wait)
    landed = None
    try:
        meta = lease.meta
        if not isinstance(meta, dict) or meta.get(META_TAG) != 1:
            raise LayoutMismatch(
                f"{request!r} was not published by {__name__} (no model facts in its meta)"
            )
        published = KVSpec.from_meta(meta)
        local.check_published(published, request)
        extra = meta.get("extra") or {}
        if not isinstance(extra, Mapping):
            raise LayoutMismatch(
                f"{request!r}: its meta's extra is a {type(extra).__name__}, "
                "not the mapping publish_cache records"
            )
        batch, heads, dim = int(meta["batch"]), local.num_kv_heads, local.head_dim
        dt = _torch_dtype(local.dtype)
        kvs, groups, nbytes = [], [], 0
        for i, (kname, vname) in enumerate(_buffer_names(local.num_layers)):
            both = torch.empty(
                (2, batch, heads, int(meta["layer_tokens"][i]), dim), dtype=dt, device=device
            )
            for c, name in enumerate((kname, vname)):
                if name not in lease:
                    raise LayoutMismatch(f"layout mismatch on buffers: {request!r} has no {name}")
                _check_size(both[c], lease[name])
                if not overlapping:
                    _copy_from_pool(both[c], lease[name])
                nbytes += lease[name].nbytes
            kvs.append((both[0], both[1]))
            groups.append({kname: both[0], vname: both[1]})
        seq_len = int(meta["seq_len"])
        rebuilt = _build_cache(config, kvs, seq_len)  # (overlap: a mismatch raises before a copy)
        claimed = ClaimedCache(rebuilt, seq_len, published, dict(extra), nbytes)
        if overlapping:
            late = LateLanding()
            guard_layers(rebuilt, late)  # before the copies: nothing can fail after them
            after = (lambda: _consume(client, request, namespace)) if consume else None
            landed = gpu.land(lease, groups, after=after)  # the lease is the landing's now
            late.landing = claimed.landing = landed
            claimed.seconds = time.perf_counter() - started
            return claimed
    except BaseException:
        if landed is not None:
            # (only an interrupt gets here) The copies are queued: the finisher releases the
            # lease once they have landed; a claim that raised counts no consume, unless the
            # finisher counted it already.
            if not landed.cancel_after() and consume:
                log.warning(
                    "claim_cache of %r was interrupted after its copies had landed: "
                    "its consume was counted",
                    request,
                )
            raise
        try:
            lease.release(consume=False)
        except KVBrokerError:
            pass  # the original exception matters more; the lease ends with the session
        raise
    lease.release()
    if consume:  # only now: a claim that failed above consumed nothing
        _consume(client, request, namespace)
    claimed.seconds = time.perf_counter() - started
    return claimed


# -- heterogeneous TP (kvbroker.kv) ----------------------------------------------------------


def publish_tp_shard(
    client: Client,
    request: str,
    cache: Any,
    *,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int,
    decode_tp_size: int | None = None,
    namespace: str = "default",
    ttl: float | None = None,
    replace: bool = False,
) -> PublishResult:
    """Publish TP rank ``tp_rank``'s cache (holding its heads only) as a ``kvbroker.kv`` shard.

    ``cache``: this rank's DynamicCache, batch 1, full-attention layers; its KV heads must be
    ``shard_heads(tp_rank, tp_size, total_kv_heads)``. The shard is staged once into a host
    tensor (see the module doc), then copied into the pool.
    """
    layers = _read_layers(cache)
    k0 = layers[0].keys
    if k0.shape[0] != 1:
        raise BadRequest(f"a TP shard holds one request: batch must be 1, not {k0.shape[0]}")
    if any(layer.stored != layer.seen for layer in layers):
        raise BadRequest(
            "a TP shard needs full-attention layers (a sliding-window layer has "
            "dropped tokens); publish it with publish_cache"
        )
    torch = _torch()
    staged = torch.empty((len(layers), 2, 1, k0.shape[1], k0.shape[2], k0.shape[3]), dtype=k0.dtype)
    for i, layer in enumerate(layers):
        _np_copyto(_ints(staged[i, 0]).numpy(), _copy_source(layer.keys.cpu()))
        _np_copyto(_ints(staged[i, 1]).numpy(), _copy_source(layer.values.cpu()))
    return publish_shard(
        client,
        request,
        PagedKV(staged, _STAGED_AXES),
        [0],
        layers[0].seen,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
        decode_tp_size=decode_tp_size,
        namespace=namespace,
        ttl=ttl,
        replace=replace,
    )


def claim_tp_shard(
    client: Client,
    request: str,
    *,
    tp_rank: int,
    tp_size: int,
    prefill_tp_size: int,
    model: Any = None,
    config: Any = None,
    dtype: Any = None,
    num_tokens: int | None = None,
    namespace: str = "default",
    wait: float | None = None,
    consume: bool = True,
    device: Any = None,
) -> ClaimedCache:
    """Decode rank ``tp_rank`` of ``tp_size``: a DynamicCache holding exactly its KV heads.

    Reads the heads it needs from whichever of the ``prefill_tp_size`` shards hold them
    (:func:`kvbroker.kv.claim_shards`), straight into the new cache's memory. ``num_tokens``:
    the prompt length if known; else one extra round trip reads it from a shard's meta.
    """
    torch = _torch()
    started = time.perf_counter()
    spec, config = _local_spec(model, config, dtype)
    mine = shard_heads(tp_rank, tp_size, spec.num_kv_heads)
    if num_tokens is None:
        first = claim_plan(spec.num_kv_heads, prefill_tp_size, tp_size, tp_rank)[0].prefill_rank
        with client.claim(
            shard_key(request, first, prefill_tp_size),
            namespace=namespace,
            select=SELECT_NOTHING,
            wait=wait,
        ) as peek:
            if not isinstance(peek.meta, dict) or "num_tokens" not in peek.meta:
                raise LayoutMismatch(f"{request!r}: shard meta has no num_tokens")
            num_tokens = int(peek.meta["num_tokens"])
    staged = torch.empty(
        (spec.num_layers, 2, 1, len(mine), num_tokens, spec.head_dim),
        dtype=_torch_dtype(spec.dtype),
    )
    result = claim_shards(
        client,
        request,
        PagedKV(staged, _STAGED_AXES),
        [0],
        tp_rank=tp_rank,
        tp_size=tp_size,
        prefill_tp_size=prefill_tp_size,
        total_kv_heads=spec.num_kv_heads,
        num_tokens=num_tokens,
        namespace=namespace,
        wait=wait,
        consume=consume,
    )
    if device is not None and torch.device(device).type != "cpu":
        staged = staged.to(device)
    kvs = [(staged[i, 0], staged[i, 1]) for i in range(spec.num_layers)]  # [1, heads, seq, dim]
    rebuilt = _build_cache(config, kvs, num_tokens)
    return ClaimedCache(
        rebuilt, num_tokens, spec, {}, result.nbytes, time.perf_counter() - started, result
    )


def head_shard(cache: Any, tp_rank: int, tp_size: int, *, config: Any = None):
    """Emulation: the DynamicCache TP rank ``tp_rank`` of ``tp_size`` would hold (views of
    ``cache``'s heads, no copy; the caller's ``cache`` keeps owning the memory)."""
    layers = _read_layers(cache)
    total = layers[0].keys.shape[1]
    heads = shard_heads(tp_rank, tp_size, total)
    kvs = [
        (layer.keys[:, heads.start : heads.stop], layer.values[:, heads.start : heads.stop])
        for layer in layers
    ]
    return _build_cache(config, kvs, layers[0].seen)


def merge_head_shards(caches: Sequence[Any], *, total_kv_heads: int, config: Any = None):
    """Emulation: reassemble the full-head DynamicCache from decode ranks ``0..D-1``'s caches.

    Copies (a real TP engine never reassembles); with replicated heads (D > heads), each head
    is taken from the first rank holding it.
    """
    torch = _torch()
    shards = [_read_layers(c) for c in caches]
    tp = len(shards)
    sources = {}  # head -> (rank, index within the rank's shard)
    for rank in range(tp):
        held = shard_heads(rank, tp, total_kv_heads)
        for j, head in enumerate(held):
            sources.setdefault(head, (rank, j))
    kvs = []
    for i in range(len(shards[0])):
        parts_k, parts_v = [], []
        for head in range(total_kv_heads):
            rank, j = sources[head]
            parts_k.append(shards[rank][i].keys[:, j : j + 1])
            parts_v.append(shards[rank][i].values[:, j : j + 1])
        kvs.append((torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)))
    return _build_cache(config, kvs, shards[0][0].seen)


# -- prefix blocks (kvbroker.prefix) ---------------------------------------------------------


# -- abort -----------------------------------------------------------------------------------


def discard(client: Client, request: str, *, namespace: str = "default") -> int:
    """Request abort after publication: evict ``request``'s object and its TP shards.

    Returns how many objects were freed; objects a claimer holds a lease on are skipped (the
    claimer's release or consume frees them, eviction reclaims them otherwise).
    """
    pattern = rf"{re.escape(request)}(?:/tp\d+of\d+)?"
    return client.evict(match=f"^{pattern}$", namespace=namespace).count
