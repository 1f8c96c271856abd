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

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._client.client import Client, ReadLease
from ._client.copy import copy_into, nbytes_of
from ._wire.names import check_infix, kv_buffer_name
from ._client.tp import claim_plan, readers_of, shard_heads
from .errors import BadRequest, Incomplete, KVBrokerError, LayoutMismatch, NotFound, Timeout
from .layout import Layout, check_compatible, shard_storage

__all__ = [
    "PagedKV",
    "PublishResult",
    "ClaimResult",
    "shard_key",
    "publish_shard",
    "claim_shards",
    "UNKNOWN_CONSUMERS",
]

META_TAG = "kvbroker.kv"  # meta key marking (and versioning) a shard published by this module
UNKNOWN_CONSUMERS = 1 << 16  # the broker's maximum: consume-claims never free it, eviction does
# A select that maps no buffer (a claim that only pins or counts down), for other modules: a
# class that matches no character, valid for RE2 (the daemon's engine: no lookarounds) and re.
_SELECT_NOTHING = r"[^\s\S]"
_CANONICAL = ("kv", "block", "token", "head", "head_dim")


def _np():
    import numpy

    return numpy


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


def shard_key(request: str, tp_rank: int, tp_size: int) -> str:
    """The broker key of prefill rank ``tp_rank``'s shard of ``request``."""
    return f"{request}/tp{tp_rank}of{tp_size}"


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
            self.layouts = [Layout.from_tensor(t, axes, iterated=self._iterated(axes))
                            for t in tensors]  # fmt: skip
        else:
            if "layer" not in axes:
                raise BadRequest("PagedKV: one tensor for all layers needs a 'layer' axis")
            li = axes.index("layer")
            layer_axes = axes[:li] + axes[li + 1 :]
            whole = Layout.from_tensor(layers, axes, iterated=("layer", *self._iterated(layer_axes)))
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
                raise BadRequest(f"PagedKV: layer {i} is {lay.dtype}{lay.shape}, layer 0 is "
                                 f"{first.dtype}{first.shape}")  # fmt: skip
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


@dataclass
class PublishResult:
    """What ``publish_shard`` did. ``published`` is False when no decode rank reads the shard."""

    key: str
    published: bool
    consumers: int
    copy_ops: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class ClaimResult:
    """What ``claim_shards`` did: the shards read, copy operations issued, bytes written.

    ``source_runs`` counts contiguous runs read from the pool: one per (shard, layer, K/V).
    """

    keys: list[str]
    copy_ops: int = 0
    source_runs: int = 0
    nbytes: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    pieces: list = field(default_factory=list)


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
    if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (len(ids) == 1 or (ids[1:] > ids[:-1]).all()):
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
    return (heads == n and dst.strides[3] == size and dst.strides[2] == dim * size
            and n * dim * size >= WHOLE_ROW_MIN_BYTES)  # fmt: skip


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


def _buffer_names(cache: PagedKV, infix: str | None) -> list[list[str]]:
    return [[kv_buffer_name(kind, i, infix) for kind in cache.components]
            for i in range(cache.num_layers)]  # fmt: skip


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
    mine = shard_heads(tp_rank, tp_size, heads)
    if cache.local_heads != len(mine):
        raise LayoutMismatch(
            f"layout mismatch on KV heads: TP rank {tp_rank} of {tp_size} holds {len(mine)} of "
            f"{heads} heads, but its cache has {cache.local_heads}"
        )
    key = shard_key(request, tp_rank, tp_size)
    if decode_tp_size is None:
        consumers = UNKNOWN_CONSUMERS
    else:
        consumers = readers_of(tp_rank, heads, tp_size, decode_tp_size)
        if consumers == 0:
            return PublishResult(key, False, 0, seconds=time.perf_counter() - started)
    ids = _block_index(block_ids, num_tokens, cache.block_size, cache.num_blocks)
    storage = shard_storage(cache.dtype, cache.num_layers, len(cache.components), len(mine),
                            num_tokens, cache.head_dim)  # fmt: skip
    buffer_layout = storage.select("layer", 0).select("kv", 0)
    names = _buffer_names(cache, infix)
    sizes = {name: buffer_layout.nbytes for row in names for name in row}
    extra = dict(extra or {})
    for name in extra:
        if name in sizes:
            raise BadRequest(f"extra buffer {name!r} collides with a KV buffer name")
        sizes[name] = nbytes_of(extra[name])
    meta = {
        META_TAG: 1,
        "request": request,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "total_kv_heads": heads,
        "heads": [mine.start, mine.stop],
        "num_tokens": num_tokens,
        "num_layers": cache.num_layers,
        "components": list(cache.components),
        "infix": infix,
        "layout": buffer_layout.to_dict(),
        "engine_layout": cache.layouts[0].to_dict(),
        "decode_tp_size": decode_tp_size,
    }
    ops = 0
    with client.reserve(key, sizes, namespace=namespace, meta=meta, ttl=ttl, replace=replace,
                        consumers=consumers) as lease:  # fmt: skip
        for layer, row in enumerate(names):
            for c, name in enumerate(row):
                dst = _split_view(lease[name].view(cache._canonical[0].dtype),
                                  (len(mine), num_tokens, cache.head_dim))  # fmt: skip
                ops += _gather(cache.component(layer, c), ids, num_tokens, dst)
        for name, value in extra.items():
            if sizes[name]:
                copy_into(lease[name], value)
                ops += 1
    return PublishResult(key, True, consumers, ops, sum(sizes.values()),
                         time.perf_counter() - started)  # fmt: skip


def _pin_shards(
    client: Client, request: str, keys: list[str], namespace: str, wait: float | None,
    consume: bool,
) -> dict[str, ReadLease]:
    """Read leases (consume claims if ``consume``) on every key, waiting at most ``wait``
    seconds in all; NotFound/Incomplete (and every pin released uncounted) if some are not
    sealed by then. The pins map every buffer (no select regex): a lease holds the whole
    object anyway, and a regex costs the daemon one RE2 match per buffer name."""
    deadline = None if not wait else time.monotonic() + wait
    pins: dict[str, ReadLease] = {}
    missing: list[str] = []
    try:
        for key in keys:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pins[key] = client.claim(key, namespace=namespace, wait=left, consume=consume)
            except (NotFound, Timeout):
                missing.append(key)
    except BaseException:
        _release_all(pins.values(), counted=False)
        raise
    if missing:
        _release_all(pins.values(), counted=False)
        waited = f" after waiting {wait:g} s" if wait else ""
        if len(missing) == len(keys):
            raise NotFound(
                f"request {request!r} is unknown in namespace {namespace!r}{waited}: none of "
                f"the shards this rank needs ({', '.join(keys)}) is published"
            )
        raise Incomplete(
            f"request {request!r} is incomplete{waited}: shards {', '.join(missing)} are not "
            f"sealed (sealed: {', '.join(pins)})"
        )
    return pins


def _release_all(leases: Iterable[ReadLease], *, counted: bool = True) -> None:
    """End the pins. ``counted`` False: a consume claim ends without counting towards freeing
    the shard (``release(consume=False)``, one round trip; failure paths only)."""
    for lease in leases:
        try:
            if counted:
                lease.release()  # pipelined: its reply is checked by the next call
            elif not lease.ended:
                lease._drop_views()
                lease.client._call("release", lease=lease.id, consume=False)
        except KVBrokerError:
            pass  # the lease ended already (TTL, connection): nothing left to release


def _check_shard(meta: Any, key: str, cache: PagedKV, heads: int | None, prefill_tp: int,
                 infix: str | None) -> int:  # fmt: skip
    """Check a shard's meta against the claimer's cache; returns its ``num_tokens``."""

    def mismatch(what: str, published: Any, local: Any) -> LayoutMismatch:
        return LayoutMismatch(
            f"layout mismatch on {what} ({key}): published {published!r}, local {local!r}"
        )

    if not isinstance(meta, dict) or meta.get(META_TAG) != 1:
        raise LayoutMismatch(f"{key} was not published by kvbroker.kv (no shard layout in meta)")
    if meta["components"] != list(cache.components):
        raise mismatch("K/V components (latent vs per-head cache)", meta["components"],
                       list(cache.components))  # fmt: skip
    if meta["tp_size"] != prefill_tp:
        raise mismatch("prefill TP size", meta["tp_size"], prefill_tp)
    if meta["total_kv_heads"] != heads:
        raise mismatch("total KV heads", meta["total_kv_heads"], heads)
    if meta["num_layers"] != cache.num_layers:
        raise mismatch("layers", meta["num_layers"], cache.num_layers)
    if meta["infix"] != infix:
        raise mismatch("buffer infix", meta["infix"], infix)
    published = Layout.from_dict(meta["layout"])
    check_compatible(published, cache.layouts[0], ("head_dim",), what=key)
    return int(meta["num_tokens"])


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
    mine = shard_heads(tp_rank, tp_size, heads)
    if cache.local_heads != len(mine):
        raise LayoutMismatch(
            f"layout mismatch on KV heads: decode TP rank {tp_rank} of {tp_size} needs "
            f"{len(mine)} of {heads} heads, but its cache has {cache.local_heads}"
        )
    plan = claim_plan(heads, prefill_tp_size, tp_size, tp_rank)
    keys = list(dict.fromkeys(shard_key(request, p.prefill_rank, prefill_tp_size) for p in plan))
    # The pin maps every buffer (select None): a lease holds the whole object anyway, the KV
    # names are looked up by name below, and a KV select regex costs the daemon one regex
    # match per buffer (~2.5 µs each under RE2: a third of a ms for 64 layers).
    pins = _pin_shards(client, request, keys, namespace, wait, consume)
    claimed = False
    waited = time.perf_counter() - started
    result = ClaimResult(keys, pieces=plan, wait_seconds=waited)
    try:
        tokens = {key: _check_shard(pins[key].meta, key, cache, heads, prefill_tp_size, infix)
                  for key in keys}  # fmt: skip
        if len(set(tokens.values())) != 1:
            raise LayoutMismatch(f"layout mismatch on num_tokens across shards: {tokens}")
        total = next(iter(tokens.values()))
        if num_tokens is not None and num_tokens != total:
            raise LayoutMismatch(f"layout mismatch on num_tokens: published {total}, "
                                 f"local {num_tokens}")  # fmt: skip
        ids = _block_index(block_ids, total, cache.block_size, cache.num_blocks)
        full_index = _as_index(ids[: total // cache.block_size])
        names = _buffer_names(cache, infix)
        int_dtype = cache._canonical[0].dtype
        # Every piece's source run per (layer, K/V), checked before the first byte moves.
        sources = []
        for piece in plan:
            key = shard_key(request, piece.prefill_rank, prefill_tp_size)
            lease = pins[key]
            stored = Layout.from_dict(lease.meta["layout"])
            # One contiguous run per (layer, K/V): heads are outermost in a stored buffer.
            (run,) = stored.narrow("head", piece.src_head, piece.count).descriptors()
            extents = lease.extents()
            missing = [n for row in names for n in row if n not in extents]
            if missing:
                raise LayoutMismatch(f"layout mismatch on buffers: {key} has no {missing[0]}")
            if any(extents[n][2] != stored.nbytes for row in names for n in row):
                raise LayoutMismatch(f"layout mismatch on buffer sizes: {key} does not hold "
                                     f"{stored.nbytes} bytes per buffer")  # fmt: skip
            sources.append((piece, extents, run))
        # Read-only use of the pinned pool bytes, viewed straight from the mapping: one
        # constructor call per copy instead of view + slice + reshape.
        np = _np()
        maps = {e[0]: client._mapping(e[0]).mm for _, ext, _ in sources for e in ext.values()}
        dim = cache.head_dim
        # (layer, K/V) outermost, shards innermost: the pieces of one destination component
        # land back to back while its cache lines are still hot (an NHD row is written by
        # every contributing shard; shard-outermost order went to DRAM once per shard).
        for layer, row in enumerate(names):
            for c, name in enumerate(row):
                dst = cache.component(layer, c)
                for piece, ext, (offset, nbytes) in sources:
                    pool, start, _ = ext[name]
                    src = np.ndarray((piece.count, total, dim), int_dtype, maps[pool],
                                     start + offset)  # fmt: skip
                    result.copy_ops += _scatter(src, dst, ids, full_index, total, piece.dst_head)
                    result.source_runs += 1
                    result.nbytes += nbytes
        result.num_tokens = total
        claimed = True
    finally:
        # Every copy landed: releasing the consume claims counts them. Anything else (a
        # mismatch, an error mid-copy) ends them uncounted, so nothing is consumed.
        _release_all(pins.values(), counted=claimed)
    result.seconds = time.perf_counter() - started
    return result
