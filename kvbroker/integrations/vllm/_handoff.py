"""Same-node P/D handoff: KV from a prefill engine's paged CUDA cache to a decode engine's,
GPU to GPU through the daemon's staging rings (``kvbroker serve --gpu-ring SIZE``).

No vLLM import. The producer's worker publishes each request's blocks of a step as one ring
object per decode rank it feeds (a *run*), gathered straight from its paged cache into the
ring region; the consumer's worker scatters each run straight from the ring (mapped over
CUDA IPC; a peer read over NVLink when the ring is on another GPU) into its own paged cache.
Nothing crosses PCIe. ``kv_connector_extra_config`` keys (:class:`HandoffConfig`):

- ``handoff``: ``"off"`` (default), ``"ring"`` (hand off through a ring; a request whose ring
  has no room goes through the host pools instead) or ``"ring+host"`` (hand off, and publish
  to the host pools too: they stay the copy of record, for later prefix reuse and for a
  decode engine on another node). Both engines set it; a consumer with it looks in the rings
  first, per request, and takes the host path for what they do not hold.
- ``handoff_tp_size`` (producer): the decode engine's TP size (default: the producer's own).
  Heterogeneous TP: producer rank r gathers, for each decode rank d, only the heads d takes
  from r (:func:`kvbroker.blocks.claim_plan`), so d reads exactly its own heads.
- ``handoff_rings`` (producer): the ring index (``kvbroker stat``: one per GPU) each decode
  rank's runs go to, e.g. the decode ranks' own GPUs; default: the producer's own GPU's ring,
  which the decode ranks read over CUDA IPC.
- ``handoff_ttl`` (seconds): how long a sealed run waits for its consumer before the daemon
  frees it (default: the daemon's ring object TTL).

A run's key names its first block's hash, its decode rank and its producer rank
(:func:`run_key`); its meta holds the block count, a digest of the run's block hashes and the
head range, so a consumer never scatters a run that is not the one its prompt needs.

Who owns and frees what: the producer holds a write lease on each run's region from its
reserve to its seal (a producer that dies before sealing: its connection's leases end, the
regions are freed); a sealed run is the daemon's until one consumer consume-reads it (the
read lease ends after the scatter ran, and the region is freed) or its TTL ends. A consumer
that dies holding a read lease: the run goes back for a retry, then expires. The engine's
paged caches stay vLLM's; nothing here keeps a reference to a block after the step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker import blocks
from kvbroker.errors import KVBrokerError, LayoutMismatch, NotFound, PoolFull

__all__ = [
    "HANDOFF_KEYS",
    "HANDOFF_MODES",
    "HANDOFF_STATS",
    "HandoffConfig",
    "HandoffWorker",
    "Run",
    "find_runs",
    "load_runs",
    "publish_runs",
    "run_digest",
    "run_key",
]

HANDOFF_MODES = ("off", "ring", "ring+host")
# The kv_connector_extra_config keys HandoffConfig.from_extra reads.
HANDOFF_KEYS = ("handoff", "handoff_tp_size", "handoff_rings", "handoff_ttl")
RUN_TAG = "kvbroker.handoff"  # in every run's meta, with its format version
RUN_VERSION = 1
# The worker's counters (._worker.STAT_KEYS): blocks handed off through the rings each way,
# and blocks a producer sent to the host path instead (its ring had no room).
HANDOFF_STATS = ("handoff_saved_blocks", "handoff_loaded_blocks", "handoff_fallback_blocks")


@dataclass(frozen=True)
class HandoffConfig:
    mode: str = "off"
    consumer_tp: int | None = None  # producer: the decode engine's TP size (None: own)
    rings: tuple[int, ...] = ()  # producer: ring index per decode rank (empty: own GPU's)
    ttl: float | None = None

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def host_too(self) -> bool:
        return self.mode == "ring+host"

    @classmethod
    def from_extra(cls, extra: dict) -> HandoffConfig:
        mode = extra.get("handoff", "off")
        if mode not in HANDOFF_MODES:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFF_MODES)}, not {mode!r}")
        tp = extra.get("handoff_tp_size")
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ValueError(f"handoff_tp_size must be a positive int, not {tp!r}")
        rings = extra.get("handoff_rings", ())
        if not isinstance(rings, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rings
        ):
            raise ValueError(f"handoff_rings must be a list of ring indices, not {rings!r}")
        if rings and tp is not None and len(rings) != tp:
            raise ValueError(f"handoff_rings names {len(rings)} rings for {tp} decode ranks")
        ttl = extra.get("handoff_ttl")
        if ttl is not None and (
            not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl < float("inf")
        ):
            raise ValueError(f"handoff_ttl must be a positive number of seconds, not {ttl!r}")
        return cls(mode, tp, tuple(rings), None if ttl is None else float(ttl))


def run_key(first_hash: str, to_rank: int, to_tp: int, from_rank: int, from_tp: int) -> str:
    return f"{first_hash}.handoff.d{to_rank}of{to_tp}.p{from_rank}of{from_tp}"


def run_digest(hashes: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()[:32]


def _pairs(heads: int | None, producer_tp: int, consumer_tp: int):
    """(decode rank, its piece from each producer rank) for every decode rank."""
    return [
        (d, p)
        for d in range(consumer_tp)
        for p in blocks.claim_plan(heads, producer_tp, consumer_tp, d)
    ]


@dataclass(frozen=True)
class Run:
    """Blocks ``[start, start + count)`` of a prompt's keys are held in the rings, one run
    object per (decode rank, producer rank) pair, under ``run_key(first_hash, ...)``."""

    first_hash: str
    start: int
    count: int
    producer_tp: int


# ------------------------------------------------------------------------ scheduler side
def find_runs(
    client,
    namespace: str,
    keys: Sequence[str],
    *,
    heads: int | None,
    consumer_tp: int,
    producer_tps: Sequence[int],
) -> list[Run]:
    """The leading runs of ``keys`` (a prompt's block keys from its first block) the rings
    hold for EVERY decode rank of this engine: one ring_lookup per run, no lease."""
    for producer_tp in dict.fromkeys(producer_tps):
        pairs = _pairs(heads, producer_tp, consumer_tp)
        runs: list[Run] = []
        at = 0
        while at < len(keys):
            names = [
                run_key(keys[at], d, consumer_tp, p.prefill_rank, producer_tp) for d, p in pairs
            ]
            found = blocks.ring_lookup(client, namespace, names)
            counts = {_run_count(f, keys, at) for f in found}
            if len(counts) != 1 or 0 in counts:
                break
            n = counts.pop()
            runs.append(Run(keys[at], at, n, producer_tp))
            at += n
        if runs:
            return runs
    return []


def _run_count(found: dict | None, keys: Sequence[str], at: int) -> int:
    """How many blocks a looked-up run covers from ``at`` (0: absent, or not this prompt's)."""
    meta = (found or {}).get("meta") or {}
    n = meta.get("blocks")
    if meta.get(RUN_TAG) != RUN_VERSION or not isinstance(n, int) or n < 1 or at + n > len(keys):
        return 0
    return n if meta.get("digest") == run_digest(keys[at : at + n]) else 0


# ------------------------------------------------------------------------- producer side
def _shape(cache, count: int, n: int) -> tuple[int, ...]:
    L, C, _B, N, _H, D = cache.shape
    return (n, L, C, count, N, D)


def publish_runs(
    rings: Any,
    namespace: str,
    cache,
    fmt,
    requests: Sequence[tuple[str, list]],
    config: HandoffConfig,
    *,
    stream=None,
) -> tuple[list[str], int, int]:
    """Publish each request's save items (``[(req_id, [SaveItem...])]``) as ring runs, one per
    decode rank fed by this rank. Returns ``(request ids handed off, blocks, bytes)``; a
    request whose rings have no room (or that fails otherwise) is not in the list, and holds
    no ring space: the caller saves it through the host pools.

    ``rings``: a :class:`kvbroker.gpu.GpuClient` (``ring_reserve``/``local_ring``)."""
    import torch

    consumer_tp = config.consumer_tp or fmt.tp_size
    heads = fmt.total_kv_heads
    mine = [
        (d, p) for d, p in _pairs(heads, fmt.tp_size, consumer_tp) if p.prefill_rank == fmt.tp_rank
    ]
    if not mine:
        return [], 0, 0
    own_ring = None
    done, n_blocks, n_bytes = [], 0, 0
    cuda = cache.device.type == "cuda"
    for req_id, items in requests:
        if not items:
            continue
        hashes = [it.block_hash for it in items]
        ids = [it.block_id for it in items]
        meta_base = {
            RUN_TAG: RUN_VERSION,
            "blocks": len(items),
            "digest": run_digest(hashes),
            "dtype": fmt.dtype,
        }
        regions = []
        try:
            for d, p in mine:
                if config.rings:
                    ring = config.rings[d]
                else:
                    own_ring = rings.local_ring() if own_ring is None else own_ring
                    ring = own_ring
                shape = _shape(cache, p.count, len(items))
                nbytes = cache.element_size()
                for x in shape:
                    nbytes *= x
                meta = {
                    **meta_base,
                    "shape": list(shape),
                    "heads": [fmt.heads[0] + p.src_head, p.count],
                }
                regions.append(
                    (
                        p,
                        rings.ring_reserve(
                            nbytes,
                            key=run_key(hashes[0], d, consumer_tp, fmt.tp_rank, fmt.tp_size),
                            ring=ring,
                            namespace=namespace,
                            meta=meta,
                            ttl=config.ttl,
                            wait=0.0,
                        ),
                    )
                )
            side = stream
            if cuda and side is not None:  # (asked before the context makes `side` current)
                side.wait_stream(torch.cuda.current_stream(cache.device))  # the KV is written
            with torch.cuda.stream(side) if cuda and side is not None else _nothing():
                idx = torch.tensor(ids, dtype=torch.int64).to(cache.device, non_blocking=True)
                step = _chunk(cache)  # the gather's temporaries stay small beside vLLM's cache
                for at in range(0, len(ids), step):
                    got = cache.index_select(2, idx[at : at + step])  # [L, C, n, N, H, D]
                    for p, region in regions:
                        dst = region.tensor.view(cache.dtype)
                        dst = dst.view(_shape(cache, p.count, len(items)))
                        src = got[:, :, :, :, p.src_head : p.src_head + p.count]
                        src = src.permute(2, 0, 1, 4, 3, 5)
                        if dst.device == cache.device:
                            dst[at : at + step].copy_(src)
                        else:  # the decode GPU's ring: gathered here, one peer copy there
                            dst[at : at + step].copy_(src.contiguous())
            if cuda:
                torch.cuda.synchronize(cache.device)  # in the ring before a seal shows it
                for _, region in regions:
                    if region.device != cache.device:
                        torch.cuda.synchronize(region.device)
            for _, region in regions:
                region.seal()
        except KVBrokerError as exc:
            _release(r for _, r in regions)  # unsealed ones give their space back
            if not isinstance(exc, PoolFull) and not _ring_trouble(exc):
                raise
            continue
        except BaseException:
            _release(r for _, r in regions)
            raise
        done.append(req_id)
        n_blocks += len(items)
        n_bytes += sum(r.nbytes for _, r in regions)
    return done, n_blocks, n_bytes


def _ring_trouble(exc: KVBrokerError) -> bool:
    """A refusal that means "this ring cannot take the run now" (the key being handed off
    already, a ring this daemon lacks): the host path takes the request."""
    from kvbroker.errors import BadRequest, Exists

    return isinstance(exc, (Exists, BadRequest))


CHUNK_BYTES = 64 << 20  # blocks per gather/scatter: their temporaries' bound


def _chunk(cache) -> int:
    """Blocks per gather or scatter step, so that a step's temporaries stay near
    CHUNK_BYTES (a 16k-token handoff's would otherwise be the whole run, beside a GPU that
    vLLM filled with its cache)."""
    L, C, _B, N, H, D = cache.shape
    return max(1, CHUNK_BYTES // (L * C * N * H * D * cache.element_size()))


def _release(regions) -> None:
    """End ring leases; a connection already gone took them with it (nothing to end)."""
    for region in regions:
        try:
            region.release()  # a sealed region: nothing (the object is the daemon's)
        except KVBrokerError:
            pass


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------- consumer side
def load_runs(
    rings: Any,
    namespace: str,
    cache,
    fmt,
    block_ids: Sequence[int],
    runs: Sequence[Run],
    first: int,
    *,
    stream=None,
) -> tuple[int, int]:
    """Scatter ``runs`` (positions in the prompt's keys) into ``cache`` at ``block_ids``, the
    engine blocks of the prompt's blocks ``first, first + 1, ...``. Consume-reads every run
    this rank needs (one per producer rank feeding it). Returns ``(leading blocks loaded,
    bytes)``: a run gone since the lookup (expired, claimed) stops the load there; the
    caller takes the rest through the host path. Copies are done when this returns."""
    import torch

    heads = fmt.total_kv_heads
    cuda = cache.device.type == "cuda"
    loaded = 0
    moved = 0
    for run in runs:
        lo = max(first, run.start)
        hi = min(run.start + run.count, first + len(block_ids))
        if lo != first + loaded:
            break  # not contiguous with what is loaded
        if hi <= lo:
            continue
        pieces = blocks.claim_plan(heads, run.producer_tp, fmt.tp_size, fmt.tp_rank)
        regions = []
        try:
            for p in pieces:
                regions.append(
                    (
                        p,
                        rings.ring_read(
                            run_key(
                                run.first_hash,
                                fmt.tp_rank,
                                fmt.tp_size,
                                p.prefill_rank,
                                run.producer_tp,
                            ),
                            namespace=namespace,
                            consume=True,
                        ),
                    )
                )
            for p, region in regions:
                _check_run(region, run, cache, p, fmt)
            if cuda and stream is not None:  # (asked before the context makes `stream` current)
                stream.wait_stream(torch.cuda.current_stream(cache.device))  # blocks' readers
            with torch.cuda.stream(stream) if cuda and stream is not None else _nothing():
                ids = torch.tensor(list(block_ids[lo - first : hi - first]), dtype=torch.int64)
                ids = ids.to(cache.device, non_blocking=True)
                step = _chunk(cache)  # the scatter's temporaries stay small
                for p, region in regions:
                    whole = region.tensor.view(cache.dtype).view(_shape(cache, p.count, run.count))
                    whole = whole[lo - run.start : hi - run.start]
                    dst = slice(p.dst_head, p.dst_head + p.count)
                    for at in range(0, hi - lo, step):
                        src = whole[at : at + step]
                        if src.device != cache.device:
                            src = src.to(cache.device)  # one peer copy over NVLink
                        cache[:, :, ids[at : at + step], :, dst] = src.permute(1, 2, 0, 4, 3, 5)
                    moved += whole.numel() * whole.element_size()
            if cuda:
                if stream is not None:
                    torch.cuda.current_stream(cache.device).wait_stream(stream)
                    stream.synchronize()  # the read leases outlive the scatter
                torch.cuda.synchronize(cache.device)
                for _, region in regions:
                    if region.device != cache.device:
                        torch.cuda.synchronize(region.device)
        except (NotFound, LayoutMismatch):
            break
        finally:
            _release(r for _, r in regions)  # consumed: freed now
        loaded = hi - first
    return loaded, moved


def _check_run(region, run: Run, cache, piece, fmt) -> None:
    """The ring object is the run this rank needs, its bytes exactly as many as its shape
    holds (its producer may be buggy or hostile: a size that disagrees would fail the view
    in the middle of the load, or scatter bytes that are not the run's)."""
    meta = region.meta or {}
    shape = list(_shape(cache, piece.count, run.count))
    if meta.get(RUN_TAG) != RUN_VERSION or meta.get("blocks") != run.count:
        raise LayoutMismatch(f"ring run {run.first_hash} is not the run the lookup found")
    if meta.get("shape") != shape or meta.get("dtype") != fmt.dtype:
        raise LayoutMismatch(
            f"ring run {run.first_hash} holds {meta.get('dtype')} "
            f"{meta.get('shape')}, this rank needs {fmt.dtype} {shape}"
        )
    need = math.prod(shape) * cache.element_size()
    if region.tensor.numel() * region.tensor.element_size() != need:
        raise LayoutMismatch(
            f"ring run {run.first_hash} holds "
            f"{region.tensor.numel() * region.tensor.element_size()} bytes, "
            f"its shape {need}"
        )


# --------------------------------------------------------------------- the worker's hooks
class HandoffWorker:
    """:class:`._worker.WorkerSide`'s handoff steps (a mixin: it uses the worker's
    ``handoff``, ``namespace``, ``fmt``, ``cache``, ``peer_tp_sizes``, ``stats`` and GPU
    client)."""

    def _load_cuda(self, spec: Any, client: Any, stream: Any) -> int:
        """A load into a CUDA cache: the spec's ring runs first (same-node handoff), then the
        host pools for what they did not cover. Runs on the loader thread too: the ring
        part's count goes on the spec, for the worker to count (``ring_loaded``)."""
        from ._cuda import load_cuda

        loaded = 0
        if getattr(spec, "ring", ()) and self.handoff.on:
            g = self._gpu if self._gpu is not None else self._gpu_client(client)
            loaded, _ = load_runs(
                g,
                self.namespace,
                self.cache,
                self.fmt,
                spec.block_ids,
                spec.ring,
                spec.first,
                stream=stream,
            )
            spec.ring_loaded = loaded
            if loaded == len(spec.block_ids):
                return loaded
        return loaded + load_cuda(
            client,
            self.namespace,
            self.fmt,
            self.cache,
            spec.hashes[loaded:],
            spec.block_ids[loaded:],
            self.peer_tp_sizes,
            stream=stream,
        )

    def _hand_off(self, g: Any, requests: list, items: list) -> list:
        """Publish each request's blocks of the step into the GPU rings; returns what goes to
        the host pools: every block with ``ring+host``, else the requests the rings had no
        room for."""
        handed, n_blocks, _ = publish_runs(
            g, self.namespace, self.cache, self.fmt, requests, self.handoff, stream=g.stream
        )
        rest = [item for req, its in requests if req not in handed for item in its]
        self.stats["handoff_saved_blocks"] += n_blocks
        self.stats["handoff_fallback_blocks"] += len(rest)
        return items if self.handoff.host_too else rest
