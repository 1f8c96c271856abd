"""The worker-side data path for CUDA caches: broker blocks <-> a paged CUDA cache.

No vLLM import. Objects are exactly those of the host path (:mod:`._paged`), so CUDA and
host engines, and TP layouts, read each other's blocks.

- **Save** (:func:`save_cuda`): reserve the step's new blocks (one round trip per
  ``RESERVE_CHUNK``), gather their K/V from the cache into a device staging buffer laid out
  like the broker's blocks (``[block][layer][K/V][head][token][head_dim]``: one
  ``index_select`` + one permuted copy on the device), then DMA the staging buffer into the
  reserved extents (device -> registered host pool, one copy per run; a block's buffers lie
  back to back in the pool, so a block is one run and neighbouring blocks merge), synchronize,
  seal. Staging goes in chunks of at most ``STAGING_BYTES``.
- **Load** (:func:`load_cuda`): match (one read lease), DMA each matched block of every
  contributing shard host -> device staging, then scatter each shard's head range into the
  cache's blocks (one indexed copy per shard and chunk), make the caller's stream wait for
  it, synchronize (the lease must outlive the copies), release.

Every byte crosses PCIe once. Both functions also run on CPU tensors with ``copier=memmove``
(the tests' way to check the addressing without a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbroker.errors import LayoutMismatch
from kvbroker.layout import Layout

from . import _ops
from ._format import BlockFormat
from ._paged import STAGING_BYTES, SaveItem, _reserve, copier_for, match

__all__ = ["load_cuda", "save_cuda"]


def _torch():
    import torch

    return torch


def _block_runs(extents, names: list[str], nbytes: int, bases: dict, dst_of: Callable[[int], int],
                src_side: bool) -> list[tuple[int, int, int]]:  # fmt: skip
    """Copies between pool extents and a staging buffer. ``extents``: per block either an
    int64 row ``[pool, off, n, off, n...]`` or a ``{name: (pool, off, n)}`` map; ``dst_of(j)``:
    the staging address of block j's first buffer (buffers follow each other there).
    ``src_side``: the pool is the source (load) rather than the destination (save)."""
    runs = []
    width = len(names) * nbytes
    for j, ext in enumerate(extents):
        stage = dst_of(j)
        if isinstance(ext, dict):
            spans = [ext[name] for name in names]
        else:
            pool = int(ext[0])
            spans = [(pool, int(ext[1 + 2 * i]), int(ext[2 + 2 * i])) for i in range(len(names))]
        if any(s[2] != nbytes for s in spans):
            raise LayoutMismatch(f"a block buffer is not {nbytes} bytes")
        pool0, off0, _ = spans[0]
        if all(p == pool0 and off == off0 + i * nbytes for i, (p, off, _) in enumerate(spans)):
            pieces = [(bases[pool0] + off0, stage, width)]  # back to back: one run
        else:
            pieces = [(bases[p] + off, stage + i * nbytes, nbytes)
                      for i, (p, off, _) in enumerate(spans)]  # fmt: skip
        for pool_addr, stage_addr, n in pieces:
            runs.append((stage_addr, pool_addr, n) if src_side else (pool_addr, stage_addr, n))
    return runs


def _bases(client, pools) -> dict[int, int]:
    return {p: _ops.pool_address(client, p) for p in pools}


def _names(fmt: BlockFormat) -> list[str]:
    return [n for row in fmt.names for n in row]


def save_cuda(client, namespace: str, fmt: BlockFormat, cache, items: Sequence[SaveItem], *,
              stream=None, copier=None, staging_bytes: int = STAGING_BYTES) -> tuple[int, int]:
    """Publish ``items`` from ``cache`` (``(layer, kv, block, token, head, head_dim)``, see
    :func:`._paged.cuda_cache`). Returns ``(new blocks, blocks the node already held)``."""
    torch = _torch()
    cuda = cache.device.type == "cuda"
    copier = copier or copier_for(cache.device.type)
    reserved = _reserve(client, namespace, fmt, items)
    todo = [(it.block_id, res) for it, res in zip(items, reserved) if res is not None]
    existing = len(items) - len(todo)
    if not todo:
        return 0, existing
    leases = [res[0] for _, res in todo]
    names = _names(fmt)
    per_block, nbytes = fmt.block_nbytes, fmt.buffer_nbytes
    L, C, _B, N, H, D = cache.shape
    chunk = max(1, staging_bytes // per_block)
    try:
        bases = _bases(client, {e[0] for _, (_, ext) in todo for e in ext.values()})
        side = stream if stream is not None else (torch.cuda.current_stream(cache.device)
                                                  if cuda else None)  # fmt: skip
        if cuda and stream is not None:  # the copies start after the engine wrote the KV
            side.wait_stream(torch.cuda.current_stream(cache.device))
        # One staging buffer for every chunk of this call: allocating it per chunk cost a
        # fresh device allocation each time (profiled on an H100: most of a 2 GiB save).
        whole = torch.empty((min(chunk, len(todo)), L, C, H, N, D), dtype=cache.dtype,
                            device=cache.device)  # fmt: skip
        for at in range(0, len(todo), chunk):
            part = todo[at : at + chunk]
            ids = torch.tensor([b for b, _ in part], device=cache.device)
            staging = whole[: len(part)]
            with torch.cuda.stream(side) if cuda else _nullcontext():
                staging.copy_(cache.index_select(2, ids).permute(2, 0, 1, 4, 3, 5))
                base = staging.data_ptr()
                runs = _block_runs([ext for _, (_, ext) in part], names, nbytes, bases,
                                   lambda j, base=base: base + j * per_block, src_side=False)
                copier(runs, side)
            if cuda:
                side.synchronize()  # in the pool before the seal; the staging is free again
        del whole, staging
        _ops.seal_many(client, leases)
    except BaseException:
        _ops.abort_leases(client, leases)
        raise
    return len(todo), existing


def _check(meta, fmt: BlockFormat) -> Layout:
    """The stored block layout, after checking it fits ``fmt`` (else LayoutMismatch)."""
    from kvbroker.prefix import SHARD_META_TAG

    if not isinstance(meta, dict) or meta.get(SHARD_META_TAG) != 1:
        raise LayoutMismatch("matched blocks were not published in the prefix block format")
    for what, published, local in (("layers", meta["num_layers"], fmt.num_layers),
                                   ("components", meta["components"], list(fmt.components)),
                                   ("total KV heads", meta["total_kv_heads"], fmt.total_kv_heads)):
        if published != local:
            raise LayoutMismatch(f"layout mismatch on {what}: published {published!r}, "
                                 f"local {local!r}")  # fmt: skip
    stored = Layout.from_dict(meta["layout"])
    for what, published, local in (("dtype", stored.dtype, fmt.dtype),
                                   ("block size", stored.size("token"), fmt.block_size),
                                   ("head_dim", stored.size("head_dim"), fmt.head_dim)):
        if published != local:
            raise LayoutMismatch(f"layout mismatch on {what}: published {published!r}, "
                                 f"local {local!r}")  # fmt: skip
    return stored


def load_cuda(client, namespace: str, fmt: BlockFormat, cache, hashes: Sequence[str],
              block_ids: Sequence[int], peer_tp_sizes: Sequence[int] = (), *, stream=None,
              copier=None, staging_bytes: int = STAGING_BYTES) -> int:  # fmt: skip
    """Load the leading blocks of ``hashes`` the node holds into ``cache`` at ``block_ids``;
    returns how many (this rank's heads, resharded from the publisher's TP layout)."""
    torch = _torch()
    cuda = cache.device.type == "cuda"
    copier = copier or copier_for(cache.device.type)
    with match(client, namespace, fmt, hashes, peer_tp_sizes) as m:
        n = min(m.num_blocks, len(block_ids))
        if n == 0:
            return 0
        stored = _check(m.meta, fmt)
        shards = len(m.ranks)
        names, rows = _ops.match_extents(m)
        order = [names.index(x) for x in _names(fmt)] if names != _names(fmt) else None
        if order is not None and not isinstance(rows, list):
            rows = [{x: (int(r[0]), int(r[1 + 2 * i]), int(r[2 + 2 * i]))
                     for i, x in enumerate(names)} for r in rows]  # fmt: skip
        flat = _names(fmt)
        L, C, _B, N, _H, D = cache.shape
        hs = stored.size("head")
        nbytes = stored.nbytes
        per_block = nbytes * len(flat)
        pieces = [(m.ranks.index(p.prefill_rank), p.src_head, p.count, p.dst_head)
                  for p in m.plan]  # fmt: skip
        pools = ({int(r[0]) for r in rows[: n * shards]} if not isinstance(rows, list)
                 else {e[0] for r in rows[: n * shards] for e in r.values()})  # fmt: skip
        bases = _bases(client, pools)
        caller = torch.cuda.current_stream(cache.device) if cuda else None
        side = stream if stream is not None else caller
        if cuda and side is not caller:  # do not overwrite blocks the engine still reads
            side.wait_stream(caller)
        chunk = max(1, staging_bytes // (per_block * shards))
        # One staging buffer for every chunk (see save_cuda).
        whole = torch.empty((min(chunk, n), shards, L, C, hs, N, D), dtype=cache.dtype,
                            device=cache.device)  # fmt: skip
        for at in range(0, n, chunk):
            count = min(chunk, n - at)
            staging = whole[:count]
            base = staging.data_ptr()
            runs = _block_runs(rows[at * shards : (at + count) * shards], flat, nbytes, bases,
                               lambda j, base=base: base + j * per_block, src_side=True)
            ids = torch.tensor(list(block_ids[at : at + count]), device=cache.device)
            with torch.cuda.stream(side) if cuda else _nullcontext():
                copier(runs, side)
                for s, src_head, heads, dst_head in pieces:
                    src = staging[:, s, :, :, src_head : src_head + heads]  # [n, L, C, h, N, D]
                    cache[:, :, ids, :, dst_head : dst_head + heads] = src.permute(1, 2, 0, 4, 3, 5)
            if cuda:
                side.synchronize()  # the lease and the staging outlive the copies
        del whole, staging
        if cuda and side is not caller:
            caller.wait_stream(side)
    return n


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
