"""Prefix blocks of a transformers cache (:mod:`kvbroker.prefix`): publish a ``DynamicCache``'s
blocks under their token prefix, claim the longest published prefix back as a cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from ...errors import BadRequest, LayoutMismatch
from ...prefix import PrefixCache
from ._spec import (
    KVSpec,
    _build_cache,
    _copy_from_pool,
    _copy_source,
    _Layer,
    _local_spec,
    _read_layers,
    _spec_of,
    _torch,
    _torch_dtype,
)
from ._spec import META_TAG, ClaimedCache, _buffer_names


def _check_prefix_cache(layers: list[_Layer]) -> None:
    k0 = layers[0].keys
    if k0.shape[0] != 1:
        raise BadRequest(
            f"prefix blocks come from one sequence: batch must be 1, not {k0.shape[0]}"
        )
    if any(layer.stored != layer.seen for layer in layers):
        raise BadRequest(
            "prefix blocks need full-attention layers (a sliding-window layer has dropped tokens)"
        )


def publish_prefix(
    prefix_cache: PrefixCache, token_ids: Sequence[int], cache: Any, *, config: Any = None
) -> int:
    """Publish the whole blocks of ``token_ids`` that ``cache`` holds KV for (its first
    ``seq_len`` positions; a partial last block is not published). Returns how many blocks
    were new: blocks the node already has are neither gathered nor copied.
    """
    layers = _read_layers(cache)
    _check_prefix_cache(layers)
    spec = _spec_of(layers, config)
    seen = layers[0].seen
    tokens = list(token_ids)[:seen]
    bs = prefix_cache.block_size
    names = _buffer_names(len(layers))
    k0 = layers[0].keys
    block_nbytes = k0.shape[1] * bs * k0.shape[3] * k0.element_size()
    sizes = {name: block_nbytes for pair in names for name in pair}
    meta = {META_TAG: 1, **spec.to_meta(), "block_size": bs}

    def block(b: int) -> dict[str, Any]:
        span = slice(b * bs, (b + 1) * bs)
        out = {}
        for (kname, vname), layer in zip(names, layers, strict=True):
            out[kname] = _copy_source(layer.keys[0, :, span])  # [head, token, dim], strided
            out[vname] = _copy_source(layer.values[0, :, span])
        return out

    return prefix_cache.publish(tokens, block, block_sizes=sizes, meta=meta)


def claim_prefix(
    prefix_cache: PrefixCache,
    token_ids: Sequence[int],
    *,
    model: Any = None,
    config: Any = None,
    dtype: Any = None,
    device: Any = None,
) -> ClaimedCache:
    """A DynamicCache holding the longest published prefix of ``token_ids`` (at most
    ``len(token_ids) - 1`` tokens); ``seq_len`` says how many. The engine prefills
    ``token_ids[seq_len:]`` on top of it. No match: an empty cache, ``seq_len`` 0.
    """
    torch = _torch()
    started = time.perf_counter()
    spec, config = _local_spec(model, config, dtype)
    bs = prefix_cache.block_size
    nbytes = 0
    with prefix_cache.match(token_ids) as m:
        total = m.num_tokens
        if total == 0:
            return ClaimedCache(_empty_cache(config), 0, spec, {}, 0, time.perf_counter() - started)
        meta = m.meta
        if not isinstance(meta, dict) or meta.get(META_TAG) != 1:
            raise LayoutMismatch(
                "the matched prefix blocks were not published by "
                f"{__name__} (no model facts in their meta)"
            )
        spec.check_published(KVSpec.from_meta(meta), f"prefix namespace {prefix_cache.namespace!r}")
        if meta.get("block_size") != bs:
            raise LayoutMismatch(
                f"layout mismatch on block size: published {meta.get('block_size')}, local {bs}"
            )
        names = _buffer_names(spec.num_layers)
        dt = _torch_dtype(spec.dtype)
        kvs = []
        for _ in names:
            both = torch.empty(
                (2, 1, spec.num_kv_heads, total, spec.head_dim), dtype=dt, device=device
            )
            kvs.append((both[0], both[1]))
        for b, blk in enumerate(m.blocks):
            span = slice(b * bs, (b + 1) * bs)
            for (kname, vname), (k, v) in zip(names, kvs, strict=True):
                _copy_from_pool(k[0, :, span], blk[kname])
                _copy_from_pool(v[0, :, span], blk[vname])
                nbytes += 2 * blk[kname].nbytes
    return ClaimedCache(
        _build_cache(config, kvs, total), total, spec, {}, nbytes, time.perf_counter() - started
    )


def _empty_cache(config: Any):
    from transformers import DynamicCache

    return DynamicCache(config=config) if config is not None else DynamicCache()
