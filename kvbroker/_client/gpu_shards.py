"""Sharded KV from/to a paged CUDA cache: :mod:`kvbroker.kv`'s objects on the GPU path.

The same objects as the host path (key, buffer names, storage layout, meta: one
:class:`~kvbroker._client.shards.ShardSpec`, pins by :func:`~kvbroker._client.shards.pinned_shards`),
so a decode rank on either path claims what a prefill rank on either path published. One
Triton gather/scatter per shard (:mod:`kvbroker._client.kernels`) into a device staging region
(a ring scratch region when the daemon has a ring on the cache's GPU, else torch memory), and
bulk DMA between it and the registered pool. Public as :func:`kvbroker.gpu.publish_shard_cuda`
and :func:`kvbroker.gpu.claim_shards_cuda`. See ``docs/design.md``.
"""

from __future__ import annotations

from itertools import pairwise
import time
from typing import TYPE_CHECKING, Any

from . import gpu_integrity as _gi
from .gpu_client import _host_addresses
from .gpu_copy import copy_runs
from .shards import ClaimResult, PublishResult, ShardSpec, agreed_tokens, consumers_of
from .shards import needed_shards, own_heads, pinned_shards, shard_key
from ..errors import BadRequest, KVBrokerError, LayoutMismatch
from ..layout import Layout, dtype_name

if TYPE_CHECKING:
    from .gpu_client import GpuClient

__all__ = ["publish_shard_cuda", "claim_shards_cuda"]

_AXES6 = ("layer", "kv", "block", "token", "head", "head_dim")


def _paged_facts(cache, total_kv_heads):
    """(components, heads total or None) of a 6-axis paged CUDA cache (see kvbroker._client.kernels)."""
    if not getattr(cache, "is_cuda", False) or cache.dim() != 6:
        raise BadRequest(
            "the CUDA shard path takes one CUDA tensor with axes (layer, kv, block, "
            "token, head, head_dim); a host cache goes through kvbroker.kv"
        )
    kv = cache.shape[1]
    if kv == 2:
        if total_kv_heads is None:
            raise BadRequest(
                "total_kv_heads (from the model config) is required for a per-head cache"
            )
        return ("key", "value"), total_kv_heads
    if kv == 1 and cache.shape[4] == 1:
        return ("latent",), None
    raise BadRequest(
        f"the kv axis must be 2 (K, V) or 1 (an MLA latent with one head), "
        f"got shape {tuple(cache.shape)}"
    )


class _Staging:
    """A device staging region: a scratch region of the daemon's ring on the cache's GPU when
    there is one with room, else a tensor from torch's caching allocator. Freed on exit."""

    def __init__(self, g: GpuClient, nbytes: int, device) -> None:
        self.region = None
        self.in_ring = False
        try:
            if g.rings():
                self.region = g.ring_reserve(nbytes, ring=g.local_ring(device), wait=0.0)
                self.in_ring = True
        except KVBrokerError:  # no ring on that GPU, or full: do not wait, use torch memory
            self.region = None
        self.tensor = (
            self.region.tensor
            if self.region is not None
            else g._torch.empty(nbytes, dtype=g._torch.uint8, device=device)
        )

    def close(self) -> None:
        self.tensor = None
        if self.region is not None:
            self.region.release()


def _uniform_spacing(addrs: list[int], nbytes: int, itemsize: int) -> int | None:
    """The constant distance between consecutive buffers, when there is one (then one DMA
    moves them all, gaps included); None otherwise."""
    if len(addrs) == 1:
        return nbytes
    d = addrs[1] - addrs[0]
    if d < nbytes or d % itemsize or any(b - a != d for a, b in pairwise(addrs)):
        return None
    return d


def publish_shard_cuda(
    g: GpuClient,
    request: str,
    cache: Any,
    block_table: Any,
    num_tokens: int,
    *,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int | None,
    decode_tp_size: int | None = None,
    namespace: str = "default",
    infix: str | None = None,
    ttl: float | None = None,
    replace: bool = False,
    stream: Any = None,
    checksum: bool = True,
):
    """:func:`kvbroker.kv.publish_shard` for a paged CUDA cache: the same object (key, buffer
    names, storage layout, meta), so a decode rank on the host path or on a GPU claims it.

    One Triton gather of all layers and K/V into a device staging region laid out like the
    lease's buffers (a ring scratch region when the daemon has a ring on this GPU), then ONE
    device-to-host DMA into the registered pool when the buffers are evenly spaced in it (one
    per buffer otherwise), then seal. ``cache``: ``(layer, kv, block, token, head, head_dim)``
    holding this rank's heads; ``block_table``: the request's blocks, in order.
    ``checksum`` (on by default): each buffer's checksum, computed on the GPU from its slice of
    the staging region beside the DMA (as :meth:`GpuClient.publish` does), recorded at seal.
    """
    from . import kernels as _kernels

    torch = g._torch
    started = time.perf_counter()
    components, heads = _paged_facts(cache, total_kv_heads)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise BadRequest(f"num_tokens must be a positive int, not {num_tokens!r}")
    L, C, _blocks, _page, local_heads, dim = cache.shape
    mine = own_heads(tp_rank, tp_size, heads, local_heads, claiming=False)
    key = shard_key(request, tp_rank, tp_size)
    consumers = consumers_of(tp_rank, heads, tp_size, decode_tp_size)
    if consumers == 0:
        return PublishResult(key, False, 0, seconds=time.perf_counter() - started)
    spec = ShardSpec.build(
        request,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=heads,
        heads=mine,
        num_tokens=num_tokens,
        num_layers=L,
        components=components,
        dtype=dtype_name(cache),
        head_dim=dim,
        infix=infix,
        decode_tp_size=decode_tp_size,
        engine_layout=Layout.from_tensor(cache, _AXES6, iterated=_AXES6[:-1]).select("layer", 0),
    )
    names = [name for row in spec.buffer_names() for name in row]
    B = spec.layout.nbytes
    item = cache.element_size()
    table = torch.as_tensor(block_table, device=cache.device)
    lease = g.client.reserve(
        key,
        dict.fromkeys(names, B),
        namespace=namespace,
        meta=spec.to_meta(),
        ttl=ttl,
        replace=replace,
        consumers=consumers,
    )
    lease.checksum = checksum  # with checksum, lease.checksums is set below (GpuClient.publish)
    with lease:
        addrs = _host_addresses(lease)
        order = [addrs[n] for n in names]
        spacing = _uniform_spacing(order, B, item)
        slot = spacing if spacing is not None else B
        span = (len(names) - 1) * slot + B
        staging = _Staging(g, span, cache.device)
        sums = None
        try:
            st = staging.tensor[:span].view(cache.dtype)
            st = st.as_strided(
                (L, C, len(mine), num_tokens, dim),
                (C * slot // item, slot // item, num_tokens * dim, dim, 1),
            )
            ready = torch.cuda.Event()
            ready.record(g._caller_stream(stream))
            g.stream.wait_event(ready)
            with torch.cuda.stream(g.stream):
                _kernels.gather(cache, table, num_tokens, st)
            if checksum:
                # each buffer's slice of the staging region, hashed beside the DMA of it
                gathered = torch.cuda.Event()
                gathered.record(g.stream)
                slices = {n: staging.tensor[i * slot : i * slot + B] for i, n in enumerate(names)}
                sums = _gi.start_seal(
                    slices, g.client.checksum_kind, g._sum_streams_after(gathered)
                )
                del slices
            base = staging.tensor.data_ptr()
            if spacing is not None:
                runs = [(order[0], base, span)]
            else:
                runs = [(a, base + i * slot, B) for i, a in enumerate(order)]
            try:
                copies = copy_runs(runs, g.stream)
            finally:
                g.stream.synchronize()  # in the pool before the seal
            if sums is not None:
                lease.checksums = sums.values(lease)  # the kernels are done with the staging
        finally:
            if sums is not None:
                sums.wait()  # no kernel reads the staging region once it is given back
            staging.close()
    return PublishResult(
        key, True, consumers, 1 + copies, B * len(names), time.perf_counter() - started
    )


def claim_shards_cuda(
    g: GpuClient,
    request: str,
    cache: Any,
    block_table: Any,
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
    stream: Any = None,
):
    """:func:`kvbroker.kv.claim_shards` into a paged CUDA cache (heterogeneous TP included).

    Per contributing shard: its head range of every (layer, K/V) is one run in the pool;
    those runs go host→device into a staging region (a ring scratch region when there is one)
    laid out like the pool, merged into ONE DMA when the whole shard is read, then ONE Triton
    scatter writes them into this rank's heads of the request's blocks. So
    ``copy_ops <= shards × (layers × components + 1)``, independent of the token count.
    ``stream`` (default: current) waits for the copies. Same errors and consume rule as
    :func:`kvbroker.kv.claim_shards`.
    """
    from . import kernels as _kernels

    torch = g._torch
    started = time.perf_counter()
    components, heads = _paged_facts(cache, total_kv_heads)
    L, C, _blocks, _page, local_heads, dim = cache.shape
    own_heads(tp_rank, tp_size, heads, local_heads, claiming=True)
    plan, keys = needed_shards(request, heads, prefill_tp_size, tp_size, tp_rank)
    engine = Layout.from_tensor(cache, _AXES6, iterated=_AXES6[:-1]).select("layer", 0)
    # Consume claims when consuming: counted only once every copy landed (see kv.claim_shards).
    with pinned_shards(g.client, request, keys, namespace, wait, consume) as pins:
        result = ClaimResult(keys, pieces=plan, wait_seconds=time.perf_counter() - started)
        stagings: list[_Staging] = []
        try:
            specs = {}
            for k in keys:
                specs[k] = spec = ShardSpec.from_meta(pins[k].meta, k)
                spec.check(
                    k,
                    components=components,
                    num_layers=L,
                    total_kv_heads=heads,
                    tp_size=prefill_tp_size,
                    infix=infix,
                    layout=engine,
                )
            total = agreed_tokens(specs, num_tokens)
            names = [name for row in specs[keys[0]].buffer_names() for name in row]
            table = torch.as_tensor(block_table, device=cache.device)
            item = cache.element_size()
            ready = torch.cuda.Event()
            ready.record(g._caller_stream(stream))
            g.stream.wait_event(ready)
            for piece in plan:
                key = shard_key(request, piece.prefill_rank, prefill_tp_size)
                lease = pins[key]
                missing = [n for n in names if n not in lease]
                if missing:
                    raise LayoutMismatch(f"layout mismatch on buffers: {key} has no {missing[0]}")
                stored = specs[key].layout
                ((run_off, run_len),) = stored.narrow(
                    "head", piece.src_head, piece.count
                ).descriptors()
                addrs = _host_addresses(lease)
                order = [addrs[n] for n in names]
                spacing = _uniform_spacing(order, stored.nbytes, item)
                slot = spacing if spacing is not None else run_len
                span = (len(names) - 1) * slot + run_len
                staging = _Staging(g, span, cache.device)
                stagings.append(staging)
                base = staging.tensor.data_ptr()
                result.copy_ops += copy_runs(
                    [(base + i * slot, a + run_off, run_len) for i, a in enumerate(order)],
                    g.stream,
                )
                result.source_runs += len(order)
                result.nbytes += run_len * len(order)
                st = (
                    staging.tensor[:span]
                    .view(cache.dtype)
                    .as_strided(
                        (L, C, piece.count, total, dim),
                        (C * slot // item, slot // item, total * dim, dim, 1),
                    )
                )
                with torch.cuda.stream(g.stream):
                    _kernels.scatter(st, cache, table, total, head_start=piece.dst_head)
                result.copy_ops += 1
            done = torch.cuda.Event()
            done.record(g.stream)
            g._caller_stream(stream).wait_event(done)  # the engine reads nothing before this
            done.synchronize()  # the pins and stagings outlive the copies
            result.num_tokens = total
        finally:
            g.stream.synchronize()
            for s in stagings:
                s.close()
    result.seconds = time.perf_counter() - started
    return result
