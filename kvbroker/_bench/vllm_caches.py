"""vLLM 0.32-shaped hybrid KV caches without vLLM, for the GPU benchmark and the tests.

vLLM's hybrid KV cache manager keeps one memory pool that every KV cache group overlays
(``vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups``, layer-outer layouts): layer
``l`` of every group lives in the same region, ``l * num_blocks * page`` bytes into the pool,
block ``b`` of it ``b * page`` further; every group's page is the same size (vLLM picks the
attention block sizes so, and pads a Mamba state page up to it). Each layer is viewed as
``vllm.v1.kv_cache_interface.create_kv_cache_views`` does: an attention layer as ``[blocks,
heads, block_size, 2*head_dim]`` of its dtype with the NHD (``LBNHC``) or HND (``LBHNC``)
stride order, a Mamba layer as ``[blocks, 1, 1, state bytes]`` of int8 (its tensors, back to
back at the start of the page). A block id names one group's bytes at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionGroupShape", "StateGroupShape", "hybrid_pool"]


@dataclass(frozen=True)
class AttentionGroupShape:
    layers: int
    heads: int
    block_size: int
    head_dim: int
    dtype: str = "bfloat16"

    def page_nbytes(self) -> int:
        import torch

        item = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.heads * self.block_size * 2 * self.head_dim * item


@dataclass(frozen=True)
class StateGroupShape:
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def content_nbytes(self) -> int:
        import math

        import torch

        return sum(
            math.prod(s) * torch.empty((), dtype=getattr(torch, d)).element_size()
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )


def hybrid_pool(groups, num_blocks: int, device, order: str = "NHD", seed: int = 0):
    """``(kv_caches, raw)``: the per-layer views vLLM hands a connector (layer ``l`` of group
    ``g`` named ``g{g}.l{l}``) over one random pool ``raw`` (uint8) of ``num_blocks`` blocks."""
    import torch

    pages = {g.page_nbytes() for g in groups if isinstance(g, AttentionGroupShape)}
    if len(pages) != 1:
        raise ValueError(f"vLLM gives every attention group one page size, not {sorted(pages)}")
    page = pages.pop()
    for g in groups:
        if isinstance(g, StateGroupShape) and g.content_nbytes() > page:
            raise ValueError("a state page larger than the attention page")
    region = num_blocks * page
    raw = torch.empty(region * max(g.layers for g in groups), dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    raw.view(torch.int16).random_(-30000, 30000, generator=gen)
    caches = {}
    for i, g in enumerate(groups):
        for layer in range(g.layers):
            at = layer * region
            name = f"g{i}.l{layer}"
            if isinstance(g, StateGroupShape):
                content = g.content_nbytes()
                caches[name] = torch.as_strided(
                    raw.view(torch.int8),
                    (num_blocks, 1, 1, content),
                    (page, content, content, 1),
                    at,
                )
                continue
            dtype = getattr(torch, g.dtype)
            elems = raw.view(dtype)
            item = elems.element_size()
            h, n, c = g.heads, g.block_size, 2 * g.head_dim
            if order == "NHD":  # page [token][head][K|V]
                strides = (page // item, c, h * c, 1)
            elif order == "HND":  # page [head][token][K|V]
                strides = (page // item, n * c, c, 1)
            else:
                raise ValueError(f"order must be NHD or HND, not {order!r}")
            caches[name] = torch.as_strided(elems, (num_blocks, h, n, c), strides, at // item)
    return caches, raw
