r"""An SGLang "engine" for the tests: one process holding HiCache ranks, each a real host pool
and a storage backend built by SGLang's own factory, driven over stdin/stdout.

``python -m tests.sglang_helpers.engine`` reads one JSON command per line and answers one
line ``@@{json}`` (SGLang may log to stdout too). A rank is what one TP rank of an SGLang
engine holds: its ``MHATokenToKVPoolHost`` (SGLang's class, built on CPU from an
``MHABufferInfo`` over CPU device buffers, as SGLang builds it over GPU ones) and the backend
``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...), pool)`` returns,
registered with the pool as SGLang's cache controller does. Page contents are a pattern drawn
from the page hash over the model's heads, so any TP layout knows what its heads must hold.

Commands (``rank`` names a rank of this process):

- ``create``: build a rank (``layout``, ``tp_rank``, ``tp_size``, ``tp_lcm_size``, geometry,
  ``extra``: the extra config beside backend_name/module_path/class_name/interface_v1);
- ``fill`` / ``set`` / ``get`` / ``exists``: pages ``hashes`` at host page slots from ``slot``;
  ``get`` zeroes those pages first and answers which pages hold exactly their pattern;
- ``legacy_set`` / ``legacy_get``: the same through the flat-page interface;
- ``stats``, ``clear``, ``raw`` (a host page's bytes, hex), ``quit``;
- a hybrid model's rank (``create`` with ``hybrid``): beside the KV pool, SGLang's own
  ``MambaPoolHost`` (built on CPU from a ``MambaStateBufferInfo``) and a sliding-window pool
  (an ``MHATokenToKVPoolHost`` of its own), registered through ``register_mem_host_pool_v2``
  as SGLang's hybrid cache controller registers its pools; ``hybrid_set`` / ``hybrid_exists``
  / ``hybrid_get`` move a span's KV pages (v1) and its trailing Mamba state and window pages
  (v2, ``PoolTransfer``\ s with SGLang's trailing-page policy, grouped by its own
  ``_trailing_chain_groups``); ``hybrid_backup`` / ``hybrid_prefetch`` run the same through
  SGLang's ``HybridCacheController`` methods over a real ``HostPoolGroup``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback

import tests.sglang_helpers.torchvision_stub  # noqa: F401  (before any SGLang import)

# isort: split
import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

DTYPE = torch.bfloat16
ranks: dict[str, dict] = {}


def host_pool(
    layout: str, *, layers: int, heads: int, head_dim: int, page_size: int, pages: int
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool for ``pages`` pages (plus its padding page). Its device
    buffers (CPU tensors here) hold two pages: storage never reads them."""
    tokens = pages * page_size
    k = tuple(torch.zeros(2 * page_size, heads, head_dim, dtype=DTYPE) for _ in range(layers))
    v = tuple(torch.zeros(2 * page_size, heads, head_dim, dtype=DTYPE) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    # SGLang checks the machine's free memory less a 10 GiB reserve; a pool of a test or a
    # benchmark is booked against its own size instead (SGLang's scope for exactly that).
    with host_memory_budget_scope(
        2 * (tokens + page_size) * layers * heads * head_dim * DTYPE.itemsize
    ):
        return MHATokenToKVPoolHost(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page_size,
            start_layer=0,
            end_layer=layers,
            host_token_capacity=tokens + page_size,
        )


def mla_host_pool(
    layout: str, *, layers: int, latent: int, rope: int, page_size: int, pages: int
) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (one latent row of ``latent + rope`` per token and layer)."""
    bufs = tuple(torch.zeros(2 * page_size, 1, latent + rope, dtype=DTYPE) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=latent,
        qk_rope_head_dim=rope,
        kv_cache_dim=latent + rope,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    with host_memory_budget_scope(
        (pages + 1) * page_size * layers * (latent + rope) * DTYPE.itemsize
    ):
        return MLATokenToKVPoolHost(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page_size,
            start_layer=0,
            end_layer=layers,
            target_layer_num=layers,
            host_token_capacity=(pages + 1) * page_size,
        )


def mamba_host_pool(*, layers: int, slots: int):
    """SGLang's Mamba host pool (``page_first``: a slot is one row of each buffer): an SSM
    state of ``[2, 4, 8]`` fp32 and a conv state of ``[6, 3]`` bf16 per layer."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, 2, 2, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(layers, 2, 6, 3, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(slots * layers * (2 * 4 * 8 * 4 + 6 * 3 * 2) * 2):
        return MambaPoolHost(
            info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
        )


def state_pattern(page_hash: str, pool) -> torch.Tensor:
    """The bytes of a Mamba slot saved at page ``page_hash``: random bits from the hash."""
    g = torch.Generator().manual_seed(
        int(hashlib.sha256(f"state/{page_hash}".encode()).hexdigest()[:15], 16)
    )
    return torch.randint(0, 256, (pool.size_per_token,), generator=g, dtype=torch.uint8)


def logical(pool, token: int) -> torch.Tensor:
    """The page at host token ``token`` as a view ``[K/V, layer, token, head, head_dim]``
    (MLA: ``[layer, token, 1, latent]``), from the layout's definition in SGLang
    (``init_kv_buffer``), not from the backend's."""
    buf, p = pool.kv_buffer, token // pool.page_size
    if isinstance(pool, MLATokenToKVPoolHost):
        if pool.layout == "layer_first":
            return buf[:, token : token + pool.page_size]
        if pool.layout == "page_first":
            return buf[token : token + pool.page_size].permute(1, 0, 2, 3)
        if pool.layout == "page_first_direct":
            return buf[p]
        raise ValueError(pool.layout)
    if pool.layout == "layer_first":
        return buf[:, :, token : token + pool.page_size]
    if pool.layout == "page_first":
        return buf[:, token : token + pool.page_size].permute(0, 2, 1, 3, 4)
    if pool.layout == "page_first_direct":
        return buf[:, p]
    if pool.layout == "page_head":
        return buf[:, p].permute(0, 3, 2, 1, 4)
    raise ValueError(pool.layout)


def pattern(page_hash: str, rank: dict) -> torch.Tensor:
    """The page's content over this rank's heads: random bits drawn from the hash."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(page_hash.encode()).hexdigest()[:15], 16))
    if rank.get("mla"):  # the same bytes on every TP rank
        return torch.randint(
            -(2**15),
            2**15,
            (rank["layers"], rank["page_size"], 1, 2 * rank["head_dim"]),
            generator=g,
            dtype=torch.int16,
        )
    full = torch.randint(
        -(2**15),
        2**15,
        (2, rank["layers"], rank["page_size"], rank["heads_total"], rank["head_dim"]),
        generator=g,
        dtype=torch.int16,
    )
    per = rank["heads_total"] // rank["tp_size"]
    return full[:, :, :, rank["tp_rank"] * per : (rank["tp_rank"] + 1) * per]


def indices(rank: dict, slot: int, n: int) -> torch.Tensor:
    ps = rank["page_size"]
    return torch.arange(slot * ps, (slot + n) * ps, dtype=torch.int64)


def create(cmd: dict) -> dict:
    heads = cmd["heads_total"] // cmd["tp_size"]
    if cmd.get("mla"):  # latent rows of 2 * head_dim: head_dim of latent, head_dim of rope
        pool = mla_host_pool(
            cmd["layout"],
            layers=cmd["layers"],
            latent=cmd["head_dim"],
            rope=cmd["head_dim"],
            page_size=cmd["page_size"],
            pages=cmd["pages"],
        )
    else:
        pool = host_pool(
            cmd["layout"],
            layers=cmd["layers"],
            heads=heads,
            head_dim=cmd["head_dim"],
            page_size=cmd["page_size"],
            pages=cmd["pages"],
        )
    lcm = cmd.get("tp_lcm_size")
    extra = {
        "backend_name": "kvbroker",
        "module_path": "kvbroker.integrations.sglang",
        "class_name": "KVBrokerStorage",
        "interface_v1": 1,
        **cmd.get("extra", {}),
    }
    # As SGLang's cache controller derives it (_generate_storage_config)
    split = bool(lcm) and not cmd.get("mla") and pool.layout == "page_head" and lcm > cmd["tp_size"]
    config = HiCacheStorageConfig(
        tp_rank=cmd["tp_rank"],
        tp_size=cmd["tp_size"],
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=bool(cmd.get("mla")),
        enable_storage_metrics=True,
        is_page_first_layout=pool.layout == "page_first",
        model_name=cmd.get("model", "org/tiny"),
        tp_lcm_size=lcm,
        should_split_heads=split,
        extra_config=extra,
    )
    if cmd.get("subclass"):  # a pool keeping part of a page elsewhere, as MXFP8's scales
        pool.__class__ = type("ScaledMHAPool", (type(pool),), {})
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    try:
        backend.register_mem_pool_host(pool)
    except ValueError as exc:
        if not cmd.get("expect_error"):
            raise
        return {"error": str(exc)}
    more = {}
    if cmd.get("hybrid"):  # as HybridCacheController.attach_storage_backend registers them
        from sglang.srt.mem_cache.hicache_storage import PoolName

        more["swa"] = host_pool(
            cmd["layout"],
            layers=cmd["layers"],
            heads=heads,
            head_dim=cmd["head_dim"],
            page_size=cmd["page_size"],
            pages=cmd["pages"],
        )
        more["mamba"] = mamba_host_pool(layers=cmd["layers"], slots=cmd["pages"])
        backend.register_mem_host_pool_v2(pool, PoolName.KV)
        backend.register_mem_host_pool_v2(more["swa"], PoolName.SWA)
        backend.register_mem_host_pool_v2(more["mamba"], PoolName.MAMBA)
        for name, extra_pool in cmd.get("unsupported", {}).items():
            backend.register_mem_host_pool_v2(_Opaque(extra_pool), name)
    backend.on_host_pools_registered()
    ranks[cmd["rank"]] = {**cmd, "pool": pool, "backend": backend, **more}
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    return {
        "class": type(backend).__name__,
        "module": type(backend).__module__,
        "is_hicache_storage": isinstance(backend, HiCacheStorage),
        "namespace": backend.namespace,
        "split": split,
    }


class _Opaque:
    """A host pool of a kind the backend does not store (DeepSeek V4's paged pools, say)."""

    def __init__(self, kind: str) -> None:
        self.kind, self.page_size = kind, 1


def transfers(
    rank: dict, hashes: list[str], *, mamba_slot: int, swa_slot: int, window: int
) -> list:
    """The span's sidecar transfers as SGLang's hybrid controller builds them: the Mamba
    state at the span's last page, the sliding window's last ``window`` pages."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    out = [
        PoolTransfer(
            name=PoolName.MAMBA,
            keys=hashes[-1:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
            host_indices=torch.tensor([mamba_slot]),
        ),
        PoolTransfer(
            name=PoolName.SWA,
            keys=hashes[-window:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
            host_indices=indices(rank, swa_slot, window),
        ),
    ]
    for name in rank.get("unsupported", {}):
        out.append(PoolTransfer(name=name, keys=hashes[-1:], host_indices=torch.tensor([0])))
    return out


def hybrid(rank: dict, op: str, cmd: dict) -> dict:
    """``hybrid_set`` / ``hybrid_exists`` / ``hybrid_get`` of a span (``hashes``)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        _trailing_chain_groups,
    )

    backend, hashes, prefix = rank["backend"], cmd["hashes"], cmd.get("prefix")
    mamba, swa, window = rank["mamba"], rank["swa"], cmd["window"]
    swa_rank = {**rank, "pool": swa}
    moves = transfers(
        rank, hashes, mamba_slot=cmd["mamba_slot"], swa_slot=cmd["swa_slot"], window=window
    )
    state_at = lambda: mamba.get_data_page(cmd["mamba_slot"]).view(torch.uint8)  # noqa: E731
    if op == "hybrid_exists":
        found = backend.batch_exists_v2(hashes, moves, HiCacheStorageExtraInfo(prefix))
        return {
            "kv_hit_pages": found.kv_hit_pages,
            "hits": dict(found.extra_pool_hit_pages),
            "restorable": found.restorable_prefix_pages,
        }
    results = {}
    if op == "hybrid_set":
        fill(rank, hashes, cmd["slot"])
        results["kv"] = backend.batch_set_v1(
            hashes, indices(rank, cmd["slot"], len(hashes)), HiCacheStorageExtraInfo(prefix)
        )
        mamba.set_from_flat_data_page(cmd["mamba_slot"], state_pattern(hashes[-1], mamba))
        fill(swa_rank, [h + "/swa" for h in hashes[-window:]], cmd["swa_slot"])
    else:
        zero(rank, cmd["slot"], len(hashes))
        mamba.set_from_flat_data_page(
            cmd["mamba_slot"], torch.zeros(mamba.size_per_token, dtype=torch.uint8)
        )
        zero(swa_rank, cmd["swa_slot"], window)
        results["kv"] = backend.batch_get_v1(hashes, indices(rank, cmd["slot"], len(hashes)))
    call = backend.batch_set_v2 if op == "hybrid_set" else backend.batch_get_v2
    for extra_info, group in _trailing_chain_groups(prefix, hashes, moves):
        results.update({str(k): v for k, v in call(group, extra_info=extra_info).items()})
    if op == "hybrid_set" and any(results["kv"]):
        sealed(backend, hashes, HiCacheStorageExtraInfo(prefix))
    return {
        "results": results,
        "exact_kv": exact(rank, hashes, cmd["slot"]),
        "exact_state": bool(torch.equal(state_at(), state_pattern(hashes[-1], mamba))),
        "exact_swa": exact(swa_rank, [h + "/swa" for h in hashes[-window:]], cmd["swa_slot"]),
    }


def fill(rank: dict, hashes: list[str], slot: int) -> None:
    pool = rank["pool"]
    for i, h in enumerate(hashes):
        logical(pool, (slot + i) * rank["page_size"]).view(torch.int16).copy_(pattern(h, rank))


def zero(rank: dict, slot: int, n: int) -> None:
    for i in range(n):
        logical(rank["pool"], (slot + i) * rank["page_size"]).zero_()


def exact(rank: dict, hashes: list[str], slot: int) -> list[bool]:
    pool = rank["pool"]
    return [
        bool(
            torch.equal(
                logical(pool, (slot + i) * rank["page_size"]).view(torch.int16), pattern(h, rank)
            )
        )
        for i, h in enumerate(hashes)
    ]


def threads(rank: dict, rounds: int, pages: int, tag: str) -> dict:
    """SGLang's three storage threads at once on one backend: a writer (backup), a reader
    (prefetch I/O) and a counter (prefetch), each on pages of its own; every result judged."""
    import threading

    backend, problems = rank["backend"], []
    written = [[f"{tag}-w{r}-{i}" for i in range(pages)] for r in range(rounds)]
    for r in range(rounds):  # what the reader reads: stored before the threads start
        fill(rank, [f"{tag}-r{r}-{i}" for i in range(pages)], pages)
        backend.batch_set_v1([f"{tag}-r{r}-{i}" for i in range(pages)], indices(rank, pages, pages))

    def writer():
        for r in range(rounds):
            fill(rank, written[r], 0)
            if backend.batch_set_v1(written[r], indices(rank, 0, pages)) != [True] * pages:
                problems.append(f"set {r}")

    def reader():
        for r in range(rounds):
            hashes = [f"{tag}-r{r}-{i}" for i in range(pages)]
            zero(rank, 2 * pages, pages)
            if backend.batch_get_v1(hashes, indices(rank, 2 * pages, pages)) != [
                True
            ] * pages or not all(exact(rank, hashes, 2 * pages)):
                problems.append(f"get {r}")

    def counter():
        for r in range(rounds):
            if backend.batch_exists([f"{tag}-r{r}-{i}" for i in range(pages)]) != pages:
                problems.append(f"exists {r}")

    workers = [threading.Thread(target=f) for f in (writer, reader, counter)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stored = [backend.batch_exists(w) for w in written]
    return {"problems": problems, "stored": stored}


def controller(rank: dict):
    """SGLang's own HiCacheController storage code over this rank's backend: an instance
    holding only what its backup, hit-query and prefetch-transfer methods read (the rest of
    it drives GPU transfers and process groups, which storage does not touch)."""
    import queue

    from sglang.srt.managers.cache_controller import HiCacheController

    ctrl = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend, ctrl.page_size = rank["backend"], rank["page_size"]
    ctrl.mem_pool_host = ctrl.storage_host_pool = rank["pool"]
    # as attach_storage_backend picks them for "dynamic" with "interface_v1": 1
    ctrl.page_set_func, ctrl.page_get_func = ctrl._page_set_zero_copy, ctrl._page_get_zero_copy
    ctrl.prefetch_sync_queue = queue.Queue()
    return ctrl


def hybrid_controller(rank: dict):
    """SGLang's own HybridCacheController storage code over a hybrid rank: its pools in a real
    ``HostPoolGroup`` (KV the anchor, then SWA and Mamba, as its hybrid pool assembler
    groups them), an instance holding only what its backup, hit-query and prefetch-transfer
    methods read (as :func:`controller`)."""
    import queue

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    group = HostPoolGroup(
        [
            PoolEntry(
                PoolName.KV, rank["pool"], None, lambda layer: layer, is_primary_index_anchor=True
            ),
            PoolEntry(PoolName.SWA, rank["swa"], None, lambda layer: layer),
            PoolEntry(PoolName.MAMBA, rank["mamba"], None, lambda layer: layer),
        ]
    )
    ctrl = HybridCacheController.__new__(HybridCacheController)
    ctrl.storage_backend, ctrl.page_size = rank["backend"], rank["page_size"]
    ctrl.storage_config = rank["backend"].config
    ctrl.mem_pool_host, ctrl.storage_host_pool = group, rank["pool"]
    ctrl.storage_backend_type = "dynamic"
    ctrl.page_set_func, ctrl.page_get_func = ctrl._page_set_zero_copy, ctrl._page_get_zero_copy
    ctrl.prefetch_sync_queue = queue.Queue()
    return ctrl


def hybrid_through_controller(rank: dict, op: str, cmd: dict) -> dict:
    """``hybrid_backup`` / ``hybrid_prefetch`` of ``tokens`` through SGLang's hybrid
    controller (its own page hashes): the KV pages and the span's trailing sidecars."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ctrl, tokens, window = hybrid_controller(rank), cmd["tokens"], cmd["window"]
    hashes = get_storage_hash_str(tokens, None, page_size=rank["page_size"])
    mamba, swa_rank = rank["mamba"], {**rank, "pool": rank["swa"]}
    moves = transfers(
        rank, hashes, mamba_slot=cmd["mamba_slot"], swa_slot=cmd["swa_slot"], window=window
    )
    if op == "hybrid_backup":
        fill(rank, hashes, cmd["slot"])
        mamba.set_from_flat_data_page(cmd["mamba_slot"], state_pattern(hashes[-1], mamba))
        fill(swa_rank, [h + "/swa" for h in hashes[-window:]], cmd["swa_slot"])
        done = StorageOperation(
            indices(rank, cmd["slot"], len(hashes)), tokens, hash_value=hashes, pool_transfers=moves
        )
        ctrl._page_backup(done)
        return {
            "completed_tokens": done.completed_tokens,
            "pool_hits": dict(done.pool_storage_result.extra_pool_hit_pages),
        }
    fetch = PrefetchOperation(SimpleNamespace(rid="req"), tokens, pool_transfers=moves)
    hit_hashes, hit_tokens = ctrl._storage_hit_query(fetch)
    fetch.hash_value = hit_hashes
    fetch.host_indices = indices(rank, cmd["slot"], len(hit_hashes))
    zero(rank, cmd["slot"], len(hashes))
    mamba.set_from_flat_data_page(
        cmd["mamba_slot"], torch.zeros(mamba.size_per_token, dtype=torch.uint8)
    )
    zero(swa_rank, cmd["swa_slot"], window)
    ctrl._page_transfer(fetch)
    acks = []
    while not ctrl.prefetch_sync_queue.empty():
        acks.append(ctrl.prefetch_sync_queue.get_nowait().pool_hits)
    return {
        "hit_tokens": hit_tokens,
        "query_pool_hit_pages": {str(k): v for k, v in fetch.query_pool_hit_pages.items()},
        "restorable": fetch.pool_storage_result.restorable_prefix_pages,
        "sidecar_hits": [a for a in acks if a is not None],
        "exact_kv": exact(rank, hashes, cmd["slot"]),
        "exact_state": bool(
            torch.equal(
                mamba.get_data_page(cmd["mamba_slot"]).view(torch.uint8),
                state_pattern(hashes[-1], mamba),
            )
        ),
        "exact_swa": exact(swa_rank, [h + "/swa" for h in hashes[-window:]], cmd["swa_slot"]),
    }


def sealed(backend, hashes: list[str], info) -> None:
    """Return once what a write of ``hashes`` stored is visible to every engine. A batch write
    returns when its seal is sent, without waiting for the reply (one round trip per batch),
    so another engine asking at once may miss it; the writer's next call on its connection is
    answered after the seal, as SGLang's next storage call would be."""
    backend.batch_exists(hashes, info)


def handle(cmd: dict) -> dict:
    op = cmd["op"]
    if op == "create":
        return create(cmd)
    rank = ranks[cmd["rank"]]
    backend, pool = rank["backend"], rank["pool"]
    hashes, slot = cmd.get("hashes", []), cmd.get("slot", 0)
    info = HiCacheStorageExtraInfo(prefix_keys=cmd.get("prefix"))
    if op == "fill":
        fill(rank, hashes, slot)
        return {}
    if op == "set":
        if cmd.get("fill", True):
            fill(rank, hashes, slot)
        results = backend.batch_set_v1(hashes, indices(rank, slot, len(hashes)), info)
        if any(results):
            sealed(backend, hashes, info)
        return {"results": results}
    if op == "get":
        zero(rank, slot, len(hashes))
        results = backend.batch_get_v1(hashes, indices(rank, slot, len(hashes)), info)
        return {"results": results, "exact": exact(rank, hashes, slot)}
    if op == "exists":
        return {"count": backend.batch_exists(hashes, info)}
    if op == "legacy_set":
        fill(rank, hashes, slot)
        pages = [
            pool.get_data_page((slot + i) * rank["page_size"], flat=True).clone()
            for i in range(len(hashes))
        ]
        stored = backend.batch_set(hashes, pages)
        if stored:
            sealed(backend, hashes, info)
        return {"stored": stored}
    if op == "legacy_get":
        targets = [pool.get_dummy_flat_data_page() for _ in hashes]
        found = backend.batch_get(hashes, targets)
        zero(rank, slot, len(hashes))
        for i, page in enumerate(found):
            if page is not None:
                pool.set_from_flat_data_page((slot + i) * rank["page_size"], page)
        return {"found": [p is not None for p in found], "exact": exact(rank, hashes, slot)}
    if op == "stats":
        m = backend.get_stats()
        return {
            "totals": backend.stats(),
            "prefetch_pgs": list(m.prefetch_pgs),
            "backup_pgs": list(m.backup_pgs),
            "metrics_type": type(m).__name__,
        }
    if op in ("backup", "prefetch"):  # through SGLang's controller, its own page hashes
        from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        ctrl, tokens = controller(rank), cmd["tokens"]
        if op == "backup":
            hashes = get_storage_hash_str(tokens, None, page_size=rank["page_size"])
            fill(rank, hashes, slot)
            done = StorageOperation(indices(rank, slot, len(hashes)), tokens, hash_value=hashes)
            ctrl._page_backup(done)
            return {"hashes": hashes, "completed_tokens": done.completed_tokens}
        fetch = PrefetchOperation("req", tokens)
        hashes, hit_tokens = ctrl._storage_hit_query(fetch)
        fetch.hash_value = hashes
        fetch.host_indices = indices(rank, slot, len(hashes))
        zero(rank, slot, len(hashes))
        pages = ctrl._page_transfer(fetch)
        return {
            "hashes": hashes,
            "hit_tokens": hit_tokens,
            "pages": pages,
            "exact": exact(rank, hashes, slot),
        }
    if op in ("hybrid_set", "hybrid_exists", "hybrid_get"):
        return hybrid(rank, op, cmd)
    if op in ("hybrid_backup", "hybrid_prefetch"):
        return hybrid_through_controller(rank, op, cmd)
    if op == "threads":
        return threads(rank, cmd["rounds"], cmd["pages"], cmd["tag"])
    if op == "clear":
        return {"cleared": backend.clear()}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to the log, not the replies
    out.write("@@" + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            for rank in ranks.values():
                rank["backend"].close()
            break
        try:
            reply = {"ok": True, **handle(cmd)}
        except Exception as exc:  # noqa: BLE001 - the test sees it
            reply = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        out.write("@@" + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
