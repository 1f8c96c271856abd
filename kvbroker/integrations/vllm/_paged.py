"""The worker-side data path: vLLM's paged KV cache tensors <-> broker prefix blocks.

No vLLM import here (the GPU tests and benchmarks drive it without vLLM); torch is imported
only by the functions that take tensors.

vLLM 0.32 hands the connector one tensor per attention layer, logically ``[num_blocks,
kv_heads, block_size, C]`` with a stride order picked by the cache layout (NHD = ``LBNHC``,
HND = ``LBHNC``...), all layers views of one allocation at a constant layer stride. What the
bytes of a block mean depends on the attention backend (:func:`interpret`):

- ``"packed"`` (FlashAttention, FlashInfer, Triton... on CUDA): ``C = 2·head_dim``, K in
  ``[..., :head_dim]`` and V in ``[..., head_dim:]`` of each (token, head) row;
- ``"cpu"`` (vLLM's CPU backend): the same logical shape, but each (block, head) holds all
  its K rows and then all its V rows: ``[num_blocks, kv_heads, 2, block_size, head_dim]``;
- ``"latent"`` (MLA): ``[num_blocks, 1, block_size, C]``, one latent row per token.

Ownership of every buffer
-------------------------
- vLLM owns the paged cache. This module only reads the blocks named in a save and only
  writes the blocks named in a load, all within the engine step that names them: a save
  copies (host) or DMAs (CUDA, then synchronizes) before ``wait_for_save`` returns, a load
  lands before ``start_load_kv`` returns (host) or before the caller's stream may read it
  (CUDA: the stream waits on the copy's event). So vLLM may reuse or free a block as soon
  as the step that saved it is over, and nothing here keeps a reference to a block after it.
- The broker owns the pool extents. A save holds write leases on fresh blocks from
  ``reserve_blocks`` until ``seal`` (the blocks become visible, owned by the broker) or
  ``abort`` (their pages are freed); a connection that dies takes its leases with it, so a
  crashed engine leaves no half-written block. Blocks the node already holds are not
  written at all.
- A load holds one read lease (from ``match_kv``) over the matched blocks while it copies,
  released before the load returns; the blocks then stay the broker's, evictable again.
- CUDA staging buffers (torch memory, at most ``STAGING_BYTES`` each) belong to the call
  that made them and are dropped when it returns, after the copies have completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbroker import blocks
from kvbroker.errors import KVBrokerError, LayoutMismatch
from kvbroker.kv import PagedKV

from ._format import PACKED, BlockFormat

__all__ = [
    "INTERPRETATIONS",
    "STAGING_BYTES",
    "HostSave",
    "attention_format",
    "cuda_cache",
    "distinct_layers",
    "host_cache",
    "interpret",
    "load_host",
]

INTERPRETATIONS = ("packed", "cpu", "latent")
# Backends whose per-token row is K then V (vLLM 0.32 names); the CPU one has its own layout.
_PACKED = {
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "ROCM_ATTN",
    "ROCM_AITER_FA",
    "ROCM_AITER_UNIFIED_ATTN",
    "TREE_ATTN",
    "XFORMERS",
}
STAGING_BYTES = 256 << 20  # CUDA staging per chunk of blocks
RESERVE_CHUNK = 128  # blocks per reserve_blocks request (keeps frames far below 1 MiB)


def interpret(backend: str, *, latent: bool) -> str:
    """How to read a cache of attention backend ``backend`` (``get_name()``)."""
    if latent:
        return "latent"
    if backend == "CPU_ATTN":
        return "cpu"
    if backend in _PACKED:
        return "packed"
    raise KVBrokerError(
        f"kvbroker's vLLM connector does not know how attention backend {backend!r} lays out "
        f"its KV cache (known: CPU_ATTN, {', '.join(sorted(_PACKED))}, MLA backends)"
    )


def _views(tensors: Sequence, how: str):
    """Per-layer views with named axes: ``(views, axes)``."""
    if how not in INTERPRETATIONS:
        raise KVBrokerError(f"unknown cache interpretation {how!r}")
    out = []
    for t in tensors:
        if t.dim() != 4:
            raise LayoutMismatch(
                f"expected a 4-d [blocks, heads, block_size, C] cache per layer, "
                f"got shape {tuple(t.shape)}"
            )
        b, h, n, c = t.shape
        if how == "latent":
            if h != 1:
                raise LayoutMismatch(f"an MLA cache has one head row, got {h}")
            out.append(t[:, 0])
        elif c % 2:
            raise LayoutMismatch(f"the last axis holds K and V, so it must be even, got {c}")
        elif how == "cpu":
            out.append(t.view(b, h, 2, n, c // 2))
        else:
            out.append(t.unflatten(-1, (2, c // 2)))
    axes = {
        "latent": ("block", "token", "head_dim"),
        "cpu": ("block", "head", "kv", "token", "head_dim"),
        "packed": ("block", "head", "token", "kv", "head_dim"),
    }[how]
    return out, axes


def host_cache(tensors: Sequence, how: str) -> PagedKV:
    """A :class:`kvbroker.kv.PagedKV` over vLLM's per-layer CPU cache tensors (no copy)."""
    views, axes = _views(tensors, how)
    return PagedKV(views, axes)


def cuda_cache(tensors: Sequence, how: str):
    """One ``(layer, kv, block, token, head, head_dim)`` view of every layer (vLLM allocates
    all layers in one buffer at a constant layer stride); a latent cache gets size-1 kv and
    head axes. Raises LayoutMismatch when the layers are not evenly spaced."""
    import torch

    views, axes = _views(tensors, how)
    first = views[0]
    item = first.element_size()
    for v in views[1:]:
        if v.dtype != first.dtype or v.shape != first.shape or v.stride() != first.stride():
            raise LayoutMismatch("the layers' caches differ in dtype, shape or strides")
    if len(views) > 1:
        steps = {views[i + 1].data_ptr() - views[i].data_ptr() for i in range(len(views) - 1)}
        if len(steps) != 1 or next(iter(steps)) <= 0 or next(iter(steps)) % item:
            raise LayoutMismatch("the layers' caches are not evenly spaced in one allocation")
        layer_stride = next(iter(steps)) // item
    else:
        layer_stride = first.numel()
    s = dict(zip(axes, first.stride(), strict=True))
    n = dict(zip(axes, first.shape, strict=True))
    if how == "latent":
        size = (len(views), 1, n["block"], n["token"], 1, n["head_dim"])
        stride = (layer_stride, 0, s["block"], s["token"], 0, s["head_dim"])
    else:
        size = (len(views), 2, n["block"], n["token"], n["head"], n["head_dim"])
        stride = (layer_stride, s["kv"], s["block"], s["token"], s["head"], s["head_dim"])
    if stride[-1] != 1:
        raise LayoutMismatch("head_dim must be contiguous in the cache")
    return torch.as_strided(first, size, stride, first.storage_offset())


def distinct_layers(named) -> tuple[list, dict[str, int | None]]:
    """``(tensors, index)`` of vLLM's per-layer caches ``(name, tensor)``: a layer whose cache
    is another's (vLLM's cross-layer KV sharing) is stored once, its index None."""
    tensors: list = []
    seen: dict[tuple, int] = {}
    index: dict[str, int | None] = {}
    for name, t in named:
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            index[name] = None
            continue
        seen[ident] = index[name] = len(tensors)
        tensors.append(t)
    return tensors, index


def attention_format(
    tensors: Sequence,
    how: str,
    *,
    block_size: int,
    total_kv_heads: int | None,
    tp_rank: int,
    tp_size: int,
    what: str = "the cache",
) -> BlockFormat:
    """The block format of one rank's layers ``tensors`` (``[blocks, heads, block_size, C]``,
    read as ``how``), after checking them against vLLM's block size and this rank's share of
    ``total_kv_heads`` (None: an MLA latent cache); LayoutMismatch naming ``what`` if not."""
    first = tensors[0]
    _blocks, heads, slots, content = first.shape
    if slots != block_size:
        raise LayoutMismatch(
            f"{what} pages {slots} tokens per block, its block size is {block_size}"
        )
    latent = how == "latent"
    span = blocks.shard_heads(tp_rank, tp_size, None if latent else total_kv_heads)
    if not latent and heads != len(span):
        raise LayoutMismatch(
            f"TP rank {tp_rank} of {tp_size} should hold {len(span)} of "
            f"{what}'s {total_kv_heads} KV heads, it has {heads}"
        )
    return BlockFormat(
        dtype=str(first.dtype).removeprefix("torch."),
        num_layers=len(tensors),
        block_size=block_size,
        head_dim=content if latent else content // 2,
        local_heads=1 if latent else heads,
        total_kv_heads=None if latent else total_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        heads=(span.start, span.stop),
    )


# ------------------------------------------------------------------------------ host path
@dataclass
class SaveItem:
    """One block to publish: its chained hash, its parent's hash (None for block 0), and the
    engine block holding it."""

    block_hash: str
    parent: str | None
    block_id: int
    retain: dict | None = None  # the request's session (kvbroker.blocks.retention)


def by_session(parts: list) -> list:
    """``parts`` (lists of items) split where the session changes: a reservation names one."""
    out = []
    for part in parts:
        at = 0
        for i in range(1, len(part) + 1):
            if i == len(part) or part[i].retain != part[at].retain:
                out.append(part[at:i])
                at = i
    return out


def _reserve(
    client, namespace: str, fmt: BlockFormat, items: Sequence[SaveItem]
) -> blocks.Reservation:
    """Reserve ``items`` in chunks; on failure, abort what the earlier chunks reserved."""
    buffers, meta = fmt.buffers(), fmt.meta()
    whole = blocks.Reservation.empty(client, list(buffers))
    try:
        chunks = [items[at : at + RESERVE_CHUNK] for at in range(0, len(items), RESERVE_CHUNK)]
        for part in by_session(chunks):
            whole = whole + blocks.reserve(
                client, namespace, _requests(fmt, part), buffers, meta, retain=part[0].retain
            )
    except BaseException:
        whole.abort()
        raise
    return whole


def _requests(fmt: BlockFormat, items: Sequence[SaveItem]) -> list[dict]:
    return [
        {"key": fmt.key(it.block_hash), "parent": fmt.key(it.parent) if it.parent else None}
        for it in items
    ]


class HostSave:
    """Publishing some blocks of a host cache, one layer at a time.

    ``reserve()`` takes write leases on the blocks the node lacks (one round trip per
    ``RESERVE_CHUNK`` blocks); ``copy_layer(l)`` copies layer ``l``'s K and V of every such
    block into its lease (one pass over the bytes, strided on the engine side);
    ``seal()`` publishes them once every layer was copied, ``abort()`` drops them.

    ``checksums``: seal each block with its checksum (the client's kind), hashed at seal over
    the copy engine's threads: the layers of a block are written one forward step apart,
    so the hash reads the block once more, where the CUDA path hashes on the GPU."""

    def __init__(
        self,
        client,
        namespace: str,
        fmt: BlockFormat,
        cache: PagedKV,
        items: Sequence[SaveItem],
        checksums: bool = True,
    ) -> None:
        self.client, self.namespace, self.fmt, self.cache = client, namespace, fmt, cache
        self.checksums = checksums
        self.items = list(items)
        self.leases: list[int] = []
        self._targets: list[tuple[int, dict]] = []  # (engine block, extents by name)
        self._reserved: blocks.Reservation | None = None
        self._copied: set[int] = set()
        self.existing = 0
        self.done = False

    def reserve(self) -> None:
        reserved = self._reserved = _reserve(self.client, self.namespace, self.fmt, self.items)
        j = 0
        for it, lease in zip(self.items, reserved.leases, strict=True):
            if lease is None:
                self.existing += 1
            else:
                self.leases.append(lease)
                self._targets.append((it.block_id, reserved.extents(j)))
                j += 1

    @property
    def new_blocks(self) -> int:
        return len(self._targets)

    @property
    def nbytes(self) -> int:
        return self.new_blocks * self.fmt.block_nbytes

    def copy_layer(self, layer: int) -> None:
        import numpy as np

        if layer in self._copied or not self._targets:
            self._copied.add(layer)
            return
        fmt, cache = self.fmt, self.cache
        shape = (fmt.local_heads, fmt.block_size, fmt.head_dim)
        for c in range(len(fmt.components)):
            comp = cache.component(layer, c)  # [block, token, head, dim], integer view
            at, size = fmt.offset_of(layer, c), fmt.buffer_nbytes
            for block, extents in self._targets:
                pool, offset, _ = extents[PACKED]
                dst = blocks.view(self.client, (pool, offset + at, size))
                np.copyto(dst.view(comp.dtype).reshape(shape), comp[block].transpose(1, 0, 2))
        self._copied.add(layer)

    def complete(self) -> bool:
        return len(self._copied) == self.fmt.num_layers

    def seal(self) -> None:
        if not self.complete():
            raise KVBrokerError(
                f"only {len(self._copied)} of {self.fmt.num_layers} layers "
                "were copied; refusing to seal"
            )
        self.done = True
        try:
            # each block's {PACKED: checksum}, one block per job over the copy engine's threads
            sums = self._reserved.checksums([PACKED]) if self.checksums and self._targets else None
            # a chunk of blocks per request, as they were reserved: one seal of a whole long
            # prefill's blocks and their checksums would outgrow a request frame
            for at in range(0, len(self.leases), RESERVE_CHUNK):
                blocks.seal(
                    self.client,
                    self.leases[at : at + RESERVE_CHUNK],
                    None if sums is None else sums[at : at + RESERVE_CHUNK],
                )
        except BaseException:  # refused (or cut short): none is left leased until its TTL
            blocks.abort(self.client, self.leases)
            raise

    def abort(self) -> None:
        if not self.done:
            self.done = True
            blocks.abort(self.client, self.leases)


def match(
    client,
    namespace: str,
    fmt: BlockFormat,
    hashes: Sequence[str],
    peer_tp_sizes: Sequence[int] = (),
):
    """One read lease on the longest run of ``hashes`` every shard this rank needs holds
    (own TP size first, then ``peer_tp_sizes``): a :class:`kvbroker.blocks.KVPrefixMatch`."""
    return blocks.match(client, namespace, fmt, hashes, peer_tp_sizes=peer_tp_sizes)


def load_host(
    client,
    namespace: str,
    fmt: BlockFormat,
    cache: PagedKV,
    hashes: Sequence[str],
    block_ids: Sequence[int],
    peer_tp_sizes: Sequence[int] = (),
) -> int:
    """Load the leading blocks of ``hashes`` the node holds into engine blocks ``block_ids``;
    returns how many were loaded (the rest were not found and were not touched)."""
    with match(client, namespace, fmt, hashes, peer_tp_sizes) as m:
        n = min(m.num_blocks, len(block_ids))
        if n:
            m.load(cache, list(block_ids[:n]), num_blocks=n)
    return n


def copier_for(device_type: str) -> Callable[[list[tuple[int, int, int]], object], int]:
    """``copy(runs, stream)``: queue ``(dst, src, nbytes)`` copies (CUDA: one DMA per run,
    :func:`kvbroker.gpu.copy_runs`; CPU tensors, for tests: memmove now)."""
    if device_type == "cuda":
        from kvbroker.gpu import copy_runs

        return copy_runs

    def memmove(runs, _stream) -> int:
        import ctypes

        for dst, src, n in runs:
            ctypes.memmove(dst, src, n)
        return len(runs)

    return memmove
