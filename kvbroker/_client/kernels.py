"""Gather from / scatter into a paged KV cache, in the broker's storage layout, in one launch.

The engine's paged cache is given as ONE tensor whose axes are, in this order,
``(layer, kv, block, token, head, head_dim)`` with any strides, as long as ``head_dim`` is
contiguous (stride 1). A vLLM-style stack ``[layers, 2, blocks, page, heads, dim]`` is that
already; a cache stored ``[layers, 2, blocks, heads, page, dim]`` is passed as
``cache.permute(0, 1, 2, 4, 3, 5)``; an MLA latent cache adds a kv axis of size 1 with
``unsqueeze(1)``.

The staging region is ``[layer][kv][head][token][head_dim]`` (``kvbroker.layout.shard_storage``):
a tensor of shape ``(layers, kv, heads, tokens, head_dim)``, any strides with ``head_dim``
contiguous, so a head-narrowed view of a larger staging tensor is accepted.

- :func:`gather` reads tokens ``[0, num_tokens)`` of a request (token ``t`` lives in block
  ``block_table[t // page]``, slot ``t % page``) and heads ``[head_start, head_start + heads)``
  of the cache into the staging tensor. It only reads the cache.
- :func:`scatter` is the reverse: it writes the staging tensor into heads
  ``[head_start, head_start + heads)`` of the given blocks of the cache, and nothing else.

Who owns what: the caller owns every tensor; these functions allocate nothing but, on the
Triton path, an int32 copy of the block table on the cache's device. Bytes move through
unsigned-free integer views of the widest width the layout allows (bit-exact: no float
arithmetic touches KV). One launch covers all layers and both K and V.

Backend: Triton when it is importable and the tensors are on a CUDA device (or when
``TRITON_INTERPRET=1``, where the interpreter runs the same kernel on CPU tensors); otherwise a
torch reference (advanced indexing, also one gather/one index_put for all layers).
``backend=`` forces one ("triton" or "torch"). Torch and Triton are imported lazily.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from ..errors import KVBrokerError

__all__ = ["gather", "scatter", "triton_available", "select_backend"]

_INT_BY_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
TILE_BYTES = 16384  # bytes one Triton program moves per (layer, kv, head) tile
NUM_WARPS = 4


@lru_cache(maxsize=1)
def _triton():
    """The Triton module and the compiled kernels, or None when Triton is absent."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken install on a CPU-only host
        return None

    @triton.jit
    def _move(
        cache,
        staging,
        table,
        num_tokens,
        page,
        head_start,
        heads,
        c_l,
        c_c,
        c_b,
        c_t,
        c_h,
        s_l,
        s_c,
        s_h,
        s_t,
        kv: tl.constexpr,
        dim: tl.constexpr,
        block_t: tl.constexpr,
        block_d: tl.constexpr,
        to_staging: tl.constexpr,
    ):
        pid = tl.program_id(0)  # one (layer, kv, head) run of the staging region
        tile = tl.program_id(1)  # one tile of block_t tokens
        h = pid % heads
        lc = pid // heads
        c = lc % kv
        layer = lc // kv
        t = tile * block_t + tl.arange(0, block_t)
        d = tl.arange(0, block_d)
        t_ok = t < num_tokens
        blk = tl.load(table + t // page, mask=t_ok, other=0).to(tl.int64)
        slot = (t % page).to(tl.int64)
        c_row = (
            layer.to(tl.int64) * c_l + c.to(tl.int64) * c_c + (head_start + h).to(tl.int64) * c_h
        )
        c_off = c_row + blk * c_b + slot * c_t
        s_row = layer.to(tl.int64) * s_l + c.to(tl.int64) * s_c + h.to(tl.int64) * s_h
        s_off = s_row + t.to(tl.int64) * s_t
        mask = t_ok[:, None] & (d[None, :] < dim)
        if to_staging:
            x = tl.load(cache + c_off[:, None] + d[None, :], mask=mask)
            tl.store(staging + s_off[:, None] + d[None, :], x, mask=mask)
        else:
            x = tl.load(staging + s_off[:, None] + d[None, :], mask=mask)
            tl.store(cache + c_off[:, None] + d[None, :], x, mask=mask)

    return triton, _move


def triton_available() -> bool:
    return _triton() is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def select_backend(*tensors: Any) -> str:
    """ "triton" where Triton can run on these tensors (CUDA, or the interpreter), else "torch"."""
    if _triton() is None:
        return "torch"
    if all(t.is_cuda for t in tensors):
        return "triton"
    if _interpret() and not any(t.is_cuda for t in tensors):
        return "triton"
    return "torch"


def _width(tensors, dim: int) -> int:
    """The widest integer item (bytes) that divides every stride, the row and the addresses."""
    item = tensors[0].element_size()
    for w in (8, 4, 2, 1):
        if w < item or (dim * item) % w:
            continue
        ok = True
        for x in tensors:
            if x.data_ptr() % w or any((s * item) % w for s in x.stride()[:-1]):
                ok = False
                break
        if ok:
            return w
    return item


def _int_view(x, width: int):
    import torch

    as_int = x.view(getattr(torch, _INT_BY_WIDTH[x.element_size()]))
    if width == x.element_size():
        return as_int
    return as_int.view(getattr(torch, _INT_BY_WIDTH[width]))


def _check(cache, staging, block_table, num_tokens: int, head_start: int) -> int:
    if cache.dim() != 6:
        raise KVBrokerError(
            f"the paged cache must have 6 axes (layer, kv, block, token, head, head_dim), "
            f"got shape {tuple(cache.shape)}"
        )
    if staging.dim() != 5:
        raise KVBrokerError(
            f"the staging tensor must have 5 axes (layer, kv, head, token, head_dim), "
            f"got shape {tuple(staging.shape)}"
        )
    layers, kv, _blocks, page, cache_heads, dim = cache.shape
    s_layers, s_kv, heads, s_tokens, s_dim = staging.shape
    if (s_layers, s_kv, s_dim) != (layers, kv, dim):
        raise KVBrokerError(
            f"staging shape {tuple(staging.shape)} does not match the cache "
            f"(layers={layers}, kv={kv}, head_dim={dim})"
        )
    if cache.dtype != staging.dtype:
        raise KVBrokerError(f"dtype mismatch: cache {cache.dtype}, staging {staging.dtype}")
    if cache.device != staging.device:
        raise KVBrokerError(f"device mismatch: cache {cache.device}, staging {staging.device}")
    if cache.stride(-1) != 1 or staging.stride(-1) != 1:
        raise KVBrokerError("head_dim must be contiguous (stride 1) in the cache and the staging")
    if not 0 <= head_start or head_start + heads > cache_heads:
        raise KVBrokerError(
            f"heads [{head_start}, {head_start + heads}) are outside the cache's {cache_heads}"
        )
    if not 0 <= num_tokens <= s_tokens:
        raise KVBrokerError(f"num_tokens {num_tokens} exceeds the staging's {s_tokens} tokens")
    need = -(-num_tokens // page)
    if block_table.dim() != 1 or block_table.numel() < need:
        raise KVBrokerError(
            f"{num_tokens} tokens of page {page} need {need} block ids, "
            f"got a table of shape {tuple(block_table.shape)}"
        )
    return page


def _run(cache, staging, block_table, num_tokens, head_start, backend, to_staging) -> None:
    page = _check(cache, staging, block_table, num_tokens, head_start)
    if num_tokens == 0 or staging.numel() == 0:
        return
    backend = backend or select_backend(cache, staging)
    if backend == "torch":
        _torch_move(cache, staging, block_table, num_tokens, head_start, page, to_staging)
        return
    if backend != "triton":
        raise KVBrokerError(f"unknown backend {backend!r}")
    found = _triton()
    if found is None:
        raise KVBrokerError("backend 'triton' asked for, but triton is not importable")
    triton, kernel = found
    if not (cache.is_cuda or _interpret()):
        raise KVBrokerError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    import torch

    width = _width([cache, staging], cache.shape[-1])
    c = _int_view(cache, width)
    s = _int_view(staging, width)
    layers, kv, heads, _, dim = s.shape
    table = block_table[: -(-num_tokens // page)].to(device=cache.device, dtype=torch.int32)
    block_d = triton.next_power_of_2(dim)
    # about TILE_BYTES per tile: enough bytes in flight per program, few programs per run
    tile = max(1, (TILE_BYTES // width) // block_d)
    block_t = max(1, min(1024, triton.next_power_of_2(tile)))
    block_t = min(block_t, triton.next_power_of_2(num_tokens))
    grid = (layers * kv * heads, triton.cdiv(num_tokens, block_t))
    kernel[grid](
        c,
        s,
        table,
        num_tokens,
        page,
        head_start,
        heads,
        c.stride(0),
        c.stride(1),
        c.stride(2),
        c.stride(3),
        c.stride(4),
        s.stride(0),
        s.stride(1),
        s.stride(2),
        s.stride(3),
        kv=kv,
        dim=dim,
        block_t=block_t,
        block_d=block_d,
        to_staging=to_staging,
        num_warps=NUM_WARPS,
    )


def _torch_move(cache, staging, block_table, num_tokens, head_start, page, to_staging) -> None:
    import torch

    heads = staging.shape[2]
    c = _int_view(cache, cache.element_size())
    s = _int_view(staging, staging.element_size())[:, :, :, :num_tokens]
    t = torch.arange(num_tokens, device=cache.device)
    table = block_table.to(device=cache.device, dtype=torch.long)
    blk = table[t // page]
    slot = t % page
    hs = slice(head_start, head_start + heads)
    if to_staging:
        # advanced indices (block, token) are adjacent: result is [layer, kv, tokens, heads, dim]
        s.copy_(c[:, :, blk, slot, hs].permute(0, 1, 3, 2, 4))
    else:
        c[:, :, blk, slot, hs] = s.permute(0, 1, 3, 2, 4)


def gather(
    cache, block_table, num_tokens: int, staging, *, head_start: int = 0, backend: str | None = None
) -> None:
    """Copy the request's tokens and heads ``[head_start, +staging heads)`` into ``staging``."""
    _run(cache, staging, block_table, num_tokens, head_start, backend, True)


def scatter(
    staging, cache, block_table, num_tokens: int, *, head_start: int = 0, backend: str | None = None
) -> None:
    """Copy ``staging`` into heads ``[head_start, +staging heads)`` of the request's blocks."""
    _run(cache, staging, block_table, num_tokens, head_start, backend, False)
