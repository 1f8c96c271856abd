"""The worker-side data path for CUDA caches: broker blocks <-> a paged CUDA cache.

No vLLM import. Objects are exactly those of the host path (:mod:`._paged`), so CUDA and
host engines, and TP layouts, read each other's blocks.

- **Save** (:func:`save_cuda`), pipelined in chunks of blocks: reserve a chunk's new blocks
  (compact reply: one packed extent row per block, a block being one broker buffer), gather
  their K/V from the cache into device staging laid out like the broker's blocks
  (``[block][layer][K/V][head][token][head_dim]``: one ``index_select`` + one permuted copy on
  a gather stream), then DMA the staging into the reserved extents (device -> registered host
  pool, on a DMA stream; consecutive blocks merge into one run). Reservations are sent a few
  chunks ahead without waiting (:func:`kvbroker.blocks.reserve_later`), a chunk's seal is sent as soon as
  its DMA ended: the daemon's work and the gathers hide behind the DMA. Measured on an H100:
  ``benchmarks/bench_vllm_gpu.py``, where the time goes: ``benchmarks/experiments/profile_vllm_gpu.py``.
- **Load** (:func:`load_cuda`): match (one read lease, one round trip), then per chunk DMA the
  matched blocks of every contributing shard host -> device staging and scatter each shard's
  head range into the cache's blocks (one indexed copy per shard and chunk), the DMAs on
  one stream and the scatters on another, so chunk k scatters while chunk k+1 lands; all
  queued without waiting, synchronized once at the end (the lease must outlive the copies),
  then released; the caller's stream waits for the copies.

- **State pages** of a hybrid model's Mamba / linear-attention group (a
  :class:`._state.StatePages`): :func:`save_cuda` saves them the same way (the gather copies
  each page whole, every layer's state tensors back to back, the broker's page form), and
  :func:`load_state_cuda` loads them whole (DMA into staging, one scatter per state tensor).

Every byte crosses PCIe once. The functions also run on CPU tensors with ``copier=memmove``
(the tests' way to check the addressing without a GPU).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence

from kvbroker import blocks
from kvbroker.errors import KVBrokerError, LayoutMismatch, Timeout

from ._format import PACKED, BlockFormat
from ._paged import (
    RESERVE_CHUNK,
    STAGING_BYTES,
    SaveItem,
    _requests,
    by_session,
    copier_for,
    match,
)
from ._state import StatePages

__all__ = ["load_cuda", "load_state_cuda", "save_cuda"]


def _torch():
    import torch

    return torch


def _staged(torch, cache):
    """How a block of ``cache`` lies in staging, in the broker's form: ``(shape of one block,
    dtype, gather(ids, out))``, the gather filling ``out`` (``[len(ids), *shape]``) on the
    current stream."""
    if isinstance(cache, StatePages):  # a state page: every layer's state tensors in turn
        return (cache.page_nbytes,), torch.uint8, cache.gather
    L, C, _B, N, H, D = cache.shape

    def gather(ids, out) -> None:  # [block][layer][K/V][head][token][head_dim]
        out.copy_(cache.index_select(2, ids).permute(2, 0, 1, 4, 3, 5))

    return (L, C, H, N, D), cache.dtype, gather


def _map_pools(client, bases: dict[int, int], rows) -> dict[int, int]:
    """``bases`` with the address of every pool ``rows`` name (mapped once per call)."""
    for pool in set(rows[:, 0].tolist()) - bases.keys():
        bases[pool] = client.pool_address(pool)
    return bases


def _side_stream(torch, cache, stream):
    """The stream the copies go on, made to start after the engine's pending work."""
    if cache.device.type != "cuda":
        return None
    caller = torch.cuda.current_stream(cache.device)
    if stream is None or stream == caller:
        return caller
    stream.wait_stream(caller)  # the engine wrote (save) / still reads (load) these blocks
    return stream


def save_cuda(
    client,
    namespace: str,
    fmt: BlockFormat | blocks.StateFormat,
    cache,
    items: Sequence[SaveItem],
    *,
    stream=None,
    copier=None,
    staging_bytes: int = STAGING_BYTES,
    checksums: bool = True,
) -> tuple[int, int]:
    """Publish ``items`` from ``cache``: attention blocks from a ``(layer, kv, block, token,
    head, head_dim)`` view (:func:`._paged.cuda_cache`), or a state group's pages from its
    :class:`._state.StatePages` (``fmt`` a StateFormat; items without parents). Returns
    ``(new blocks, blocks the node already held)``.
    ``checksums``: seal each block with its kind-1 checksum, computed on the GPU from the
    staging while it is in device memory (where the daemon takes kind 1 and Triton runs)."""
    torch = _torch()
    cuda = cache.device.type == "cuda"
    summing = checksums and cuda and blocks.device_checksums_available(client)
    copier = copier or copier_for(cache.device.type)
    buffers, meta = fmt.buffers(), fmt.meta()
    per_block = fmt.block_nbytes
    block_shape, staging_dtype, gather_into = _staged(torch, cache)
    # two halves of the staging: chunk k+1 is gathered while chunk k is still in flight
    chunk = max(1, min(RESERVE_CHUNK, staging_bytes // (2 * per_block)))
    parts = by_session(_split(items, chunk))  # one session per reservation
    dma = _side_stream(torch, cache, stream)
    gather = None
    if cuda:  # the gather of chunk k+1 runs beside the DMA of chunk k
        gather = torch.cuda.Stream(cache.device)
        gather.wait_stream(torch.cuda.current_stream(cache.device))  # the engine wrote them
    # Reservations go into the daemon's queue AHEAD chunks ahead of the copies: it works
    # through them while earlier chunks copy, and seals join the queue as copies end.
    asked: list = []

    def ask_up_to(k: int) -> None:
        while len(asked) < min(k + 1, len(parts)):
            part = parts[len(asked)]
            asked.append(
                blocks.reserve_later(
                    client, namespace, _requests(fmt, part), buffers, meta, retain=part[0].retain
                )
            )

    unsealed: list[int] = []  # reserved, not known sealed: aborted if anything fails
    sealing: list[tuple] = []  # (pending seal_many, its leases)
    copying: collections.deque = collections.deque()  # (DMA done event or None, leases)
    free_again: list = [None, None]  # per staging half: the event its last DMA ends at
    bases: dict[int, int] = {}
    staging = None
    new = existing = 0
    answered = 0
    try:
        for k, part in enumerate(parts):
            ask_up_to(k + _AHEAD)
            res = asked[k].result()
            answered = k + 1
            leases = res.taken
            unsealed += leases
            existing += len(part) - len(leases)
            new += len(leases)
            if leases:
                if staging is None:
                    staging = torch.empty(
                        (2, min(chunk, len(items)), *block_shape),
                        dtype=staging_dtype,
                        device=cache.device,
                    )
                half = staging[k % 2][: len(leases)]
                chosen = [it.block_id for it, ls in zip(part, res.leases, strict=True) if ls]
                runs = res.runs(
                    [fmt.packed],
                    per_block,
                    _map_pools(client, bases, res.rows),
                    half.data_ptr(),
                    per_block,
                )
                done = None
                if cuda:
                    with torch.cuda.stream(gather):
                        if free_again[k % 2] is not None:  # the DMA that read this half ended
                            gather.wait_event(free_again[k % 2])
                        # made on the stream that reads it (the allocator may hand its memory
                        # to the next chunk's ids only once this gather has run), from pinned
                        # memory without blocking: a pageable copy would hold this thread
                        # until the gather stream got there (a bubble per chunk in the DMA)
                        ids = _ids_on(torch, chosen, cache.device)
                        gather_into(ids, half)
                        # each staged block's checksum, on the gather stream: the DMA
                        # stream waits for it with the gather
                        sums = blocks.start_device_checksums(half) if summing else None
                        dma.wait_stream(gather)
                    copier(runs, dma)
                    done = torch.cuda.Event()
                    done.record(dma)
                    free_again[k % 2] = done
                else:
                    gather_into(torch.tensor(chosen), half)
                    copier(runs, dma)
                    sums = None
                copying.append((done, leases, sums))
            # seal what is in the pool already, without waiting for the daemon's answer
            while copying and (copying[0][0] is None or copying[0][0].query()):
                _, done_leases, sums = copying.popleft()
                sealing.append((_seal_later(client, done_leases, sums, fmt.packed), done_leases))
        while copying:
            done, done_leases, sums = copying.popleft()
            if done is not None:
                done.synchronize()
            sealing.append((_seal_later(client, done_leases, sums, fmt.packed), done_leases))
        while sealing:
            pending, done_leases = sealing[0]
            pending.result()
            sealing.pop(0)
            _forget(unsealed, done_leases)
    except BaseException as exc:
        if cuda:
            dma.synchronize()  # no DMA may still write into pages the abort frees
            gather.synchronize()
        # a daemon that stopped answering is not waited for again, a timeout per reply
        answering = not isinstance(exc, Timeout)
        for pending, done_leases in sealing:  # what did get sealed is the broker's now
            try:
                if answering:
                    pending.result()
                    _forget(unsealed, done_leases)
            except Timeout:
                answering = False
            except KVBrokerError:
                pass
        for later in asked[answered:]:  # reservations still queued: abort them too
            try:
                if answering:
                    unsealed += later.result().taken
            except Timeout:
                answering = False
            except KVBrokerError:
                pass
        blocks.abort(client, unsealed)
        raise
    return new, existing


_AHEAD = 3  # reservations in the daemon's queue beyond the one being copied


def _split(items: Sequence, chunk: int) -> list:
    """``items`` in chunks of at most ``chunk``, smaller at both ends: the first DMA starts
    once the daemon answered a few blocks' reservation, not a full chunk's, and the last
    seal (after the last DMA, the one wait nobody hides) covers a few blocks."""
    ramp = [max(1, chunk >> s) for s in (3, 2, 1)]
    left = len(items)
    head, tail = [], []
    for size in ramp:
        if left > 2 * chunk + 2 * size:  # room for this step at both ends
            head.append(size)
            tail.insert(0, size)
            left -= 2 * size
    count = -(-left // chunk)  # the middle in near-equal chunks of at most `chunk`
    middle = [left // count + (i < left % count) for i in range(count)] if left else []
    sizes = head + middle + tail
    out, at = [], 0
    for size in sizes:
        out.append(items[at : at + size])
        at += size
    return out


def _ids_on(torch, values: list[int], device):
    """Block ids on ``device``, copied on the current stream without waiting for it."""
    host = torch.tensor(values, dtype=torch.int64).pin_memory()
    return host.to(device, non_blocking=True)  # torch keeps ``host`` until the copy ran


def _seal_later(client, leases: list[int], sums, name: str):
    if sums is None:
        return blocks.seal_later(client, leases)
    return blocks.seal_later(client, leases, [{name: v} for v in sums.result()])


def _forget(unsealed: list[int], sealed: list[int]) -> None:
    done = set(sealed)
    unsealed[:] = [lease for lease in unsealed if lease not in done]


def load_cuda(
    client,
    namespace: str,
    fmt: BlockFormat,
    cache,
    hashes: Sequence[str],
    block_ids: Sequence[int],
    peer_tp_sizes: Sequence[int] = (),
    *,
    stream=None,
    copier=None,
    staging_bytes: int = STAGING_BYTES,
) -> int:
    """Load the leading blocks of ``hashes`` the node holds into ``cache`` at ``block_ids``;
    returns how many (this rank's heads, resharded from the publisher's TP layout)."""
    import numpy as np

    torch = _torch()
    cuda = cache.device.type == "cuda"
    copier = copier or copier_for(cache.device.type)
    with match(client, namespace, fmt, hashes, peer_tp_sizes) as m:
        n = min(m.num_blocks, len(block_ids))
        if n == 0:
            return 0
        stored = fmt.check(m.meta)
        shards = len(m.ranks)
        names, rows = m.extents()
        L, C, _B, N, _H, D = cache.shape
        hs = stored.size("head")
        per_block = stored.nbytes * len(fmt.flat_names)
        # The packed buffer, or (blocks of publish_kv's form) each named buffer in its place
        # of the packed order: the same bytes either way.
        read = [PACKED] if m.meta.get("packed") == PACKED else fmt.flat_names
        if isinstance(rows, list):  # the keys' buffers differ (both block forms in one
            # chain): every block as its named buffers, a packed one's cut in its order
            read = fmt.flat_names
            rows = np.asarray(
                [_named_row(r, read, per_block) for r in rows[: n * shards]], dtype=np.int64
            )
            names = read
        rows = rows[: n * shards]
        nbytes = per_block // len(read)
        pieces = [(m.ranks.index(p.prefill_rank), p.src_head, p.count, p.dst_head) for p in m.plan]
        bases = _map_pools(client, {}, rows)
        caller = torch.cuda.current_stream(cache.device) if cuda else None
        dma = _side_stream(torch, cache, stream)
        # the scatter of chunk k runs beside the DMA of chunk k+1 (two staging halves)
        scatter = torch.cuda.Stream(cache.device) if cuda else None
        if cuda:
            scatter.wait_stream(caller)  # do not overwrite blocks the engine still reads
        chunk = max(1, staging_bytes // (2 * per_block * shards))
        staging = torch.empty(
            (2, min(chunk, n), shards, L, C, hs, N, D), dtype=cache.dtype, device=cache.device
        )
        with torch.cuda.stream(scatter) if cuda else contextlib.nullcontext():
            ids_all = (
                _ids_on(torch, list(block_ids[:n]), cache.device)
                if cuda
                else torch.tensor(list(block_ids[:n]))
            )
        free_again: list = [None, None]  # per half: the event its last scatter ends at
        try:
            for k, at in enumerate(range(0, n, chunk)):
                count = min(chunk, n - at)
                half = staging[k % 2][:count]
                runs = blocks.pool_runs(
                    rows[at * shards : (at + count) * shards],
                    names,
                    read,
                    nbytes,
                    bases,
                    half.data_ptr(),
                    per_block,
                )
                if cuda and free_again[k % 2] is not None:  # the scatter that read this half ran
                    dma.wait_event(free_again[k % 2])
                copier([(stage, pool, size) for pool, stage, size in runs], dma)
                ids = ids_all[at : at + count]
                with torch.cuda.stream(scatter) if cuda else contextlib.nullcontext():
                    if cuda:
                        scatter.wait_stream(dma)
                    for s, src_head, heads, dst_head in pieces:
                        src = half[:, s, :, :, src_head : src_head + heads]  # [n, L, C, h, N, D]
                        dst = slice(dst_head, dst_head + heads)
                        cache[:, :, ids, :, dst] = src.permute(1, 2, 0, 4, 3, 5)
                    if cuda:
                        free_again[k % 2] = torch.cuda.Event()
                        free_again[k % 2].record(scatter)
        finally:
            if cuda:  # also when a chunk failed: the lease and the staging outlive the copies
                dma.synchronize()
                scatter.synchronize()
                caller.wait_stream(scatter)
        del staging
    return n


def load_state_cuda(
    client,
    namespace: str,
    fmt: blocks.StateFormat,
    pages: StatePages,
    keys: Sequence[str],
    block_ids: Sequence[int],
    *,
    stream=None,
    copier=None,
) -> int:
    """Load the leading state pages of ``keys`` (group keys) the node holds into engine blocks
    ``block_ids`` of ``pages``, each whole: one DMA of the matched pages into device staging,
    then one scatter per state tensor, queued after the engine's pending work and
    synchronized before the read lease is released (the caller's stream waits for them).
    Returns how many loaded (a hybrid load asks one: the state at the hit)."""
    torch = _torch()
    cuda = pages.device.type == "cuda"
    copier = copier or copier_for(pages.device.type)
    with blocks.match(client, namespace, fmt, keys) as m:
        n = min(m.num_blocks, len(block_ids))
        if n == 0:
            return 0
        names, rows = m.extents()
        if isinstance(rows, list):  # (blocks of one format share their buffers)
            raise LayoutMismatch("matched state pages differ in their buffers")
        rows = rows[:n]
        per_page = fmt.block_nbytes
        if pages.page_nbytes != per_page:
            raise LayoutMismatch(
                f"the engine's state pages hold {pages.page_nbytes} bytes, the format {per_page}"
            )
        caller = torch.cuda.current_stream(pages.device) if cuda else None
        dma = _side_stream(torch, pages, stream)  # after the engine's reads of these pages
        staging = torch.empty((n, per_page), dtype=torch.uint8, device=pages.device)
        runs = blocks.pool_runs(
            rows,
            names,
            [fmt.packed],
            per_page,
            _map_pools(client, {}, rows),
            staging.data_ptr(),
            per_page,
        )
        try:
            copier([(stage, pool, size) for pool, stage, size in runs], dma)
            with torch.cuda.stream(dma) if cuda else contextlib.nullcontext():
                ids = (
                    _ids_on(torch, list(block_ids[:n]), pages.device)
                    if cuda
                    else torch.tensor(list(block_ids[:n]))
                )
                pages.scatter(ids, staging)  # after the DMA: the same stream
        finally:
            if cuda:  # also when it failed: the lease and the staging outlive the copies
                dma.synchronize()
                caller.wait_stream(dma)
        del staging
    return n


def _named_row(extents: dict, names: list[str], per_block: int) -> list[int]:
    """``[pool, offset, nbytes, ...]`` of a block's ``names`` (each ``per_block //
    len(names)`` bytes), from its own buffers or its packed one (the same bytes in that
    order)."""
    nbytes = per_block // len(names)
    whole = extents.get(PACKED)
    if whole is not None:
        pool, offset, size = whole
        if size != per_block:
            raise LayoutMismatch(
                f"layout mismatch on buffer size of {PACKED}: {size} bytes, {per_block} expected"
            )
        return [pool] + [v for i in range(len(names)) for v in (offset + i * nbytes, nbytes)]
    missing = [x for x in names if x not in extents]
    if missing:
        raise LayoutMismatch(f"layout mismatch on buffers: a matched block has no {missing[0]}")
    return [extents[names[0]][0]] + [v for x in names for v in extents[x][1:]]
