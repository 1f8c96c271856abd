"""An engine's paged KV cache on the host, and the block copies in and out of it.

:class:`PagedKV` (public as :class:`kvbroker.kv.PagedKV`) wraps the engine's tensors or
arrays as integer views, never copies. The gathers and scatters here move bytes between the
cache's blocks and a shard's ``[head][token][head_dim]`` buffers, bit-exact (unsigned integer
views of the same item size), at most two numpy copies per (shard, layer, K/V): see the module
doc of :mod:`kvbroker.kv` for why in this order. Shared by :mod:`kvbroker.kv` and
:mod:`kvbroker.prefix`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .copy import _np
from ..errors import BadRequest, LayoutMismatch
from ..layout import Layout

__all__ = ["PagedKV", "WHOLE_ROW_MIN_BYTES"]

_CANONICAL = ("kv", "block", "token", "head", "head_dim")


def _is_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _int_view(array: Any):
    """A numpy view of ``array``'s memory as unsigned ints of its item size: bytes, not values."""
    np = _np()
    if _is_torch(array):
        torch = sys.modules["torch"]
        if array.device.type != "cpu":
            raise BadRequest(
                f"kvbroker.kv moves host memory; a {array.device} tensor goes through the GPU "
                "staging path: kvbroker.gpu.publish_shard_cuda / claim_shards_cuda"
            )
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return array.detach().view(ints[array.element_size()]).numpy()
    if not isinstance(array, np.ndarray):
        raise BadRequest(f"expected a torch tensor or numpy array, got {type(array).__name__}")
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _split_view(array, shape):
    """``array`` reshaped as a view; raises instead of silently copying (writes must land)."""
    return array.reshape(shape, copy=False)


class PagedKV:
    """An engine's paged KV cache, as kv.py sees it. The engine owns the memory.

    ``layers``: one tensor/array per layer (axes without ``layer``), or one tensor with a
    ``layer`` axis. ``axes`` names every axis of a layer: ``block``, ``token`` (slots in a
    block), ``head_dim`` and, for attention caches, ``kv`` (size 2: key, value) and ``head``
    (this rank's KV heads); an MLA latent cache has neither ``kv`` nor ``head``. Examples:
    blocks-first NHD ``("block", "kv", "token", "head", "head_dim")``, K/V-first HND
    ``("kv", "block", "head", "token", "head_dim")``, MLA ``("block", "token", "head_dim")``.
    """

    def __init__(self, layers: Any, axes: Sequence[str]) -> None:
        axes = tuple(axes)
        if isinstance(layers, (list, tuple)):
            if "layer" in axes:
                raise BadRequest("PagedKV: a list of per-layer tensors has no 'layer' axis")
            tensors, layer_axes = list(layers), axes
            views = [_int_view(t) for t in tensors]
            self.layouts = [
                Layout.from_tensor(t, axes, iterated=self._iterated(axes)) for t in tensors
            ]
        else:
            if "layer" not in axes:
                raise BadRequest("PagedKV: one tensor for all layers needs a 'layer' axis")
            li = axes.index("layer")
            layer_axes = axes[:li] + axes[li + 1 :]
            whole = Layout.from_tensor(
                layers, axes, iterated=("layer", *self._iterated(layer_axes))
            )
            n = layers.shape[li]
            full = _int_view(layers)
            views = [full[(slice(None),) * li + (i,)] for i in range(n)]
            self.layouts = [whole.select("layer", i) for i in range(n)]
        if not views:
            raise BadRequest("PagedKV: a cache needs at least one layer")
        unknown = set(layer_axes) - set(_CANONICAL)
        missing = {"block", "token", "head_dim"} - set(layer_axes)
        if unknown or missing:
            raise BadRequest(
                f"PagedKV: axes {layer_axes} must name block, token, head_dim (+ kv and head "
                f"for attention caches); unknown {sorted(unknown)}, missing {sorted(missing)}"
            )
        self.latent = "head" not in layer_axes
        if self.latent == ("kv" in layer_axes):
            raise BadRequest(
                "PagedKV: an attention cache has both 'kv' and 'head' axes (K and V in one "
                "tensor per layer); a latent (MLA) cache has neither"
            )
        self.components: tuple[str, ...] = ("latent",) if self.latent else ("key", "value")
        first = self.layouts[0]
        for i, lay in enumerate(self.layouts):
            if (lay.dtype, lay.shape) != (first.dtype, first.shape):
                raise BadRequest(
                    f"PagedKV: layer {i} is {lay.dtype}{lay.shape}, layer 0 is "
                    f"{first.dtype}{first.shape}"
                )
        if not self.latent and first.size("kv") != 2:
            raise BadRequest(f"PagedKV: the 'kv' axis must have size 2, not {first.size('kv')}")
        self.axes = layer_axes
        self.dtype = first.dtype
        self.itemsize = first.itemsize
        self.num_layers = len(views)
        self.num_blocks = first.size("block")
        self.block_size = first.size("token")
        self.head_dim = first.size("head_dim")
        self.local_heads = 1 if self.latent else first.size("head")
        # Canonical views [kv, block, token, head, head_dim], size-1 kv/head for latent caches.
        order = [layer_axes.index(a) for a in _CANONICAL if a in layer_axes]
        self._canonical = []
        for v in views:
            c = v.transpose(order)
            if self.latent:
                c = c[None, :, :, None, :]
            self._canonical.append(c)

    @staticmethod
    def _iterated(axes: Sequence[str]) -> tuple[str, ...]:
        # Every axis but head_dim is walked; one head's head_dim row is the smallest run.
        return tuple(a for a in axes if a != "head_dim")

    def layer(self, layer: int):
        """Integer view ``[kv, block, token, head, head_dim]`` of one layer (size-1 kv and
        head axes for a latent cache)."""
        return self._canonical[layer]

    def component(self, layer: int, index: int):
        """Integer view ``[block, token, head, head_dim]`` of one layer's K (0), V (1) or latent."""
        return self._canonical[layer][index]


def _block_index(block_ids: Any, num_tokens: int, block_size: int, num_blocks: int):
    """The engine block ids holding tokens ``[0, num_tokens)`` as an int64 array."""
    np = _np()
    if _is_torch(block_ids):
        block_ids = block_ids.detach().cpu().numpy()
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    needed = -(-num_tokens // block_size)
    if len(ids) < needed:
        raise LayoutMismatch(
            f"layout mismatch on block size: {len(ids)} blocks of {block_size} tokens cannot "
            f"hold {num_tokens} tokens ({needed} blocks needed)"
        )
    ids = ids[:needed]
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        raise BadRequest(f"block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
    return ids


def _as_index(ids):
    """A slice when the ids are consecutive (no gather index, no temporary), else the ids."""
    if (
        len(ids)
        and ids[-1] - ids[0] == len(ids) - 1
        and (len(ids) == 1 or (ids[1:] > ids[:-1]).all())
    ):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def _gather(src, ids, num_tokens: int, dst) -> int:
    """Copy tokens of blocks ``ids`` of ``src [block, token, head, dim]`` into ``dst [head,
    token, dim]``. Returns the number of copy operations (at most 2)."""
    slots, ops = src.shape[1], 0
    full, tail = divmod(num_tokens, slots)
    heads, _, dim = dst.shape
    if full:
        out = _split_view(dst[:, : full * slots], (heads, full, slots, dim)).transpose(1, 2, 0, 3)
        # numpy gathers scattered blocks through one fancy-index pass (a layer-sized staging
        # array); consecutive blocks are a plain strided copy.
        out[...] = src[_as_index(ids[:full])]
        ops += 1
    if tail:
        dst[:, full * slots :] = src[ids[full], :tail].transpose(1, 0, 2)
        ops += 1
    return ops


# Smallest [head][head_dim] row for which writing whole rows in destination order beats
# walking the source head by head (numpy, this repo's 2-core CPU machine: 0.99-0.69x at 256 B
# to 1 KiB rows, 1.15x at 2 KiB, 1.23x at 4 KiB; benchmarks/results/tp-cpu.md).
WHOLE_ROW_MIN_BYTES = 2048


def _whole_rows(dst, heads: int) -> bool:
    """Whether a copy of ``heads`` heads into ``dst [block, token, head, dim]`` writes whole,
    contiguous token rows big enough to copy in destination order. Otherwise (part of a row:
    an NHD cache fed by several shards or sliced out of a larger one; or HND, whose rows are
    not contiguous) the copy goes head-major like the source: interleaving a row's heads
    from strided sources runs numpy 1.5-2.5x slower."""
    _, _, n, dim = dst.shape
    size = dst.itemsize
    return (
        heads == n
        and dst.strides[3] == size
        and dst.strides[2] == dim * size
        and n * dim * size >= WHOLE_ROW_MIN_BYTES
    )


def _scatter(src, dst, ids, full_index, num_tokens: int, dst_head: int) -> int:
    """Write ``src [head, token, dim]`` into heads ``dst_head..`` of blocks ``ids`` of ``dst
    [block, token, head, dim]``, with no temporary. ``full_index``: ``_as_index`` of the
    blocks filled completely. Returns the copy operations (at most 2)."""
    slots, ops = dst.shape[1], 0
    full, tail = divmod(num_tokens, slots)
    heads, _, dim = src.shape
    h = slice(dst_head, dst_head + heads)
    if full:
        by_head = _split_view(src[:, : full * slots], (heads, full, slots, dim))
        if _whole_rows(dst, heads):
            dst[full_index, :, h, :] = by_head.transpose(1, 2, 0, 3)
        else:
            dst.transpose(2, 0, 1, 3)[h, full_index] = by_head
        ops += 1
    if tail:
        dst[ids[full], :tail, h, :] = src[:, full * slots :].transpose(1, 0, 2)
        ops += 1
    return ops
