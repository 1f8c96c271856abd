"""The vLLM connector's worker-side data path on a GPU host, in one run; JSON + markdown.

Side by side in the same process and run, for a Llama-3-8B-shaped KV of 16k tokens (32 layers,
8 KV heads, head_dim 128, bf16: 2 GiB) in a vLLM 0.32 CUDA cache (NHD by default, HND with
``--order HND``; block size 16):

- worker-side **save** of every block (``_cuda.save_cuda``: reserve, on-device gather into
  staging, DMA into the registered pool, seal; wall time of the whole call) against the
  pinned D2H bandwidth of the same bytes (CUDA events), target >= 0.8x;
- worker-side **load** (``_cuda.load_cuda``: match, DMA into staging, scatter into the
  cache's blocks, release) against pinned H2D, target >= 0.8x; checked bit-exact;
- with 2 GPUs: the same KV handed from GPU 0 to GPU 1 through the daemon's staging ring
  (gather into a ring region on GPU 0, one peer copy out of it into staging on GPU 1,
  scatter) against torch's peer copy of the same bytes, target >= 0.7x; else recorded as
  skipped.

With ``--handoff``, the connector's same-node P/D handoff through the daemon's GPU staging
ring (:mod:`kvbroker._bench.handoff`): a prefill process publishes the 16k tokens' blocks into
a ring (gathered from its cache straight into the ring region), a decode process looks them up
and scatters them into its cache (the ring mapped over CUDA IPC), per round the sum of both
calls; on one GPU both processes share it, against a device-to-device copy of the same bytes
(one pass: the handoff makes two, the gather and the scatter) and against the host path
(save + load above); with 2 GPUs the producer on GPU 0 and the consumer on GPU 1, against a
peer copy (target >= 0.8x), else recorded as skipped.

With ``--hybrid SHAPE``, a hybrid model's cache instead, 16k tokens, bf16, the groups
overlaying one pool as vLLM 0.32's hybrid KV cache manager lays them out
(:mod:`kvbroker._bench.vllm_caches`), saved and loaded by the hybrid worker
(:class:`~kvbroker.integrations.vllm._hybrid_worker.HybridWorker`: one step's save of every
group's blocks, ``wait_for_save``; the load of a hit, every group's blocks in turn):

- ``gemma3``: Gemma-3-12B-like, 48 layers as vLLM groups them: 5 sliding-window groups
  (window 1024) and 1 full group of 8 layers each, 8 KV heads, head_dim 256, block 16. The
  save stores every block of every group; the load reads the full group's run and each sliding
  group's window only (65 blocks).
- ``qwen3next``: Qwen3-Next / Qwen3.5-like, 48 layers: 3 gated-delta (GDN) groups and 1 full
  group of 12 layers each; full attention 2 KV heads, head_dim 256; a GDN layer's state a conv
  state (3, 8192) and an SSM state (32, 128, 128), bf16 (1,097,728 B), so vLLM's block is 544
  tokens (the attention page it pads the state to). Save and load: the full group's blocks and
  every GDN group's state page at the end of the prompt, whole.

Each round times the pinned D2H (H2D) copy of the bytes the save (load) moves, then the save
(load) itself; the ratios are per round, their median reported with the range. The results
record the load average and CPU pressure (PSI) before and after the run.

It starts its own private daemon (pool sized for the KV) and writes ``DIR/NAME.json`` and
``DIR/NAME.md`` with the commit, the machine and the command line.

Usage: ``python benchmarks/bench_vllm_gpu.py --out DIR [--reps 5] [--order NHD|HND]
[--hybrid gemma3|qwen3next]``; ``--device cpu --tokens 512`` runs the same code on CPU tensors
(memmove for the DMA) as a check (``tests/test_bench.py`` runs the hybrid shapes so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from kvbroker import Client
from kvbroker._bench import checkout_commit
from kvbroker._bench._common import run_conditions
from kvbroker._bench.gpu_run import events_median
from kvbroker._bench.vllm_caches import AttentionGroupShape, StateGroupShape, hybrid_pool
from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
from kvbroker.integrations.vllm._format import BlockFormat
from kvbroker.integrations.vllm._paged import SaveItem, copier_for, cuda_cache
from kvbroker._bench._common import ratio as _ratio  # noqa: E402 (two decimals, cut)


NS = "vllm/bench"


def start_daemon(sock: str, pool_mib: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--socket",
            sock,
            "--pool-size",
            f"{pool_mib}M",
            "--page-size",
            "2M",
            "--log-level",
            "warning",
            *extra,
        ],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        try:
            Client(sock, map_pools=False, timeout=5).close()
            return proc
        except Exception:  # noqa: BLE001
            time.sleep(0.05)
    raise RuntimeError("daemon not ready")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vllm_cache(layers, blocks, heads, page, dim, device, order, seed=0):
    """Per-layer ``[blocks, heads, page, 2*dim]`` bf16 views of one allocation, like vLLM's."""
    c = 2 * dim
    raw = torch.empty(layers * blocks * heads * page * c, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw.view(torch.int16).random_(-30000, 30000, generator=g)
    if order == "NHD":
        strides = (blocks * page * heads * c, page * heads * c, c, heads * c, 1)
    else:
        strides = (blocks * heads * page * c, heads * page * c, page * c, c, 1)
    five = torch.as_strided(raw, (layers, blocks, heads, page, c), strides)
    return [five[i] for i in range(layers)]


def bench_save_load(a, device) -> dict:
    L, H, D, page = a.layers, a.heads, a.head_dim, a.block_size
    nblk = a.tokens // page
    fmt = BlockFormat(
        dtype="bfloat16",
        num_layers=L,
        block_size=page,
        head_dim=D,
        local_heads=H,
        total_kv_heads=H,
        tp_rank=0,
        tp_size=1,
        heads=(0, H),
    )
    nbytes = nblk * fmt.block_nbytes
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    proc = start_daemon(sock, (nbytes >> 20) + 512)
    res: dict = {
        "tokens": a.tokens,
        "blocks": nblk,
        "block_bytes": fmt.block_nbytes,
        "kv_bytes": nbytes,
        "order": a.order,
    }
    try:
        src6 = cuda_cache(vllm_cache(L, nblk + 8, H, page, D, device, a.order), "packed")
        dst6 = cuda_cache(vllm_cache(L, nblk + 8, H, page, D, device, a.order, seed=1), "packed")
        src_ids = list(range(8, nblk + 8))
        dst_ids = list(range(nblk))[::-1]  # scattered the other way round
        client = Client(sock)
        if device.type == "cuda":
            from kvbroker.gpu import GpuClient

            t0 = time.perf_counter()
            g = GpuClient(client, device=device, own_client=True)
            res["register_s"] = time.perf_counter() - t0
            stream, copier = g.stream, None
        else:
            g, stream, copier = None, None, copier_for("cpu")
        saves, loads = [], []
        for rep in range(a.reps + 1):
            hashes = [f"{rep:08x}{i:024x}" for i in range(nblk)]
            items = [
                SaveItem(h, hashes[i - 1] if i else None, b)
                for i, (h, b) in enumerate(zip(hashes, src_ids, strict=True))
            ]
            sync(device)
            t0 = time.perf_counter()
            new, _ = save_cuda(client, NS, fmt, src6, items, stream=stream, copier=copier)
            sync(device)
            t1 = time.perf_counter()
            got = load_cuda(client, NS, fmt, dst6, hashes, dst_ids, stream=stream, copier=copier)
            sync(device)
            t2 = time.perf_counter()
            assert new == nblk and got == nblk, (new, got)
            if rep == 0:  # warm-up: check the bytes
                ok = all(
                    torch.equal(src6[:, :, s].view(torch.int16), dst6[:, :, t].view(torch.int16))
                    for s, t in list(zip(src_ids, dst_ids, strict=True))[:: max(1, nblk // 64)]
                )
                res["bit_exact"] = bool(ok)
            else:
                saves.append(t1 - t0)
                loads.append(t2 - t1)
            client.evict(namespace=NS)
        res["save_s"] = statistics.median(saves)
        res["load_s"] = statistics.median(loads)
        res["save_GBps"] = nbytes / res["save_s"] / 1e9
        res["load_GBps"] = nbytes / res["load_s"] / 1e9
        res["save_runs"] = "one DMA run per block, adjacent blocks merged"
        if g is not None:
            g.close()
        else:
            client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return res


def bench_pinned(nbytes: int, reps: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = events_median(partial(host.copy_, dev, non_blocking=True), reps)
    h2d = events_median(partial(dev.copy_, host, non_blocking=True), reps)
    del dev, host
    return {"pinned_d2h_GBps": nbytes / d2h / 1e9, "pinned_h2d_GBps": nbytes / h2d / 1e9}


def bench_ring(a) -> dict:
    """GPU 0 -> GPU 1: gather into a ring region on GPU 0, seal; on GPU 1 claim it (one peer
    copy into staging) and scatter into the decode cache; against a peer copy of the bytes."""
    from kvbroker.gpu import GpuClient

    L, H, D, page = a.layers, a.heads, a.head_dim, a.block_size
    nblk = a.tokens // page
    per_block = L * 2 * H * page * D * 2
    nbytes = nblk * per_block
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    proc = start_daemon(sock, 256, "--gpu-ring", f"{(nbytes >> 20) + 64}M")
    res: dict = {"kv_bytes": nbytes}
    try:
        d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
        src6 = cuda_cache(vllm_cache(L, nblk, H, page, D, d0, a.order), "packed")
        dst6 = cuda_cache(vllm_cache(L, nblk, H, page, D, d1, a.order, seed=1), "packed")
        a0 = torch.empty(nbytes, dtype=torch.uint8, device=d0)
        b1 = torch.empty(nbytes, dtype=torch.uint8, device=d1)
        res["peer_access"] = bool(torch.cuda.can_device_access_peer(1, 0))
        res["peer_copy_GBps"] = nbytes / events_median(partial(b1.copy_, a0), a.reps) / 1e9
        del a0, b1
        ids0 = torch.arange(nblk, device=d0)
        ids1 = torch.arange(nblk, device=d1).flip(0)
        staging1 = torch.empty((nblk, L, 2, H, page, D), dtype=torch.bfloat16, device=d1)
        with (
            GpuClient(Client(sock), own_client=True, device=d0) as p,
            GpuClient(Client(sock), own_client=True, device=d1) as c,
        ):
            times = []
            for rep in range(a.reps + 1):
                key = f"kv{rep}"
                torch.cuda.synchronize(d0)
                torch.cuda.synchronize(d1)
                t0 = time.perf_counter()
                region = p.ring_reserve(
                    nbytes,
                    key=key,
                    ring=p.local_ring(d0),
                    meta={"buffers": {"kv": [0, nbytes, "uint8", [nbytes]]}},
                )
                st = region.tensor.view(torch.bfloat16).view(nblk, L, 2, H, page, D)
                with torch.cuda.stream(p.stream):
                    st.copy_(src6.index_select(2, ids0).permute(2, 0, 1, 4, 3, 5))
                p.stream.synchronize()
                region.seal()
                c.ring_claim(key, {"kv": staging1.view(torch.uint8).view(-1)})
                dst6[:, :, ids1] = staging1.permute(1, 2, 0, 4, 3, 5)
                torch.cuda.synchronize(d1)
                if rep:
                    times.append(time.perf_counter() - t0)
            res["ring_handoff_s"] = statistics.median(times)
            res["ring_handoff_GBps"] = nbytes / res["ring_handoff_s"] / 1e9
            ok = torch.equal(
                src6[:, :, 0].view(torch.int16).to(d1), dst6[:, :, nblk - 1].view(torch.int16)
            )
            res["bit_exact"] = bool(ok)
    finally:
        proc.terminate()
        proc.wait(30)
    return res


def bench_handoffs(a) -> dict:
    """--handoff: the same-node handoff on one GPU (two processes), and GPU 0 -> GPU 1."""
    from kvbroker._bench.handoff import bench_handoff

    nbytes = a.tokens * a.layers * 2 * a.heads * a.head_dim * 2
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    proc = start_daemon(sock, 256, "--gpu-ring", f"{(nbytes >> 20) + 64}M")
    out: dict = {}
    try:
        out["one_gpu"] = bench_handoff(sock, a, "cuda:0", "cuda:0")
        print(
            "handoff, one GPU",
            {k: v for k, v in out["one_gpu"].items() if k != "rounds"},
            flush=True,
        )
        if torch.cuda.device_count() >= 2:
            out["two_gpus"] = bench_handoff(sock, a, "cuda:0", "cuda:1")
        else:
            out["two_gpus_skipped"] = f"needs 2 GPUs ({torch.cuda.device_count()} visible)"
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def markdown_handoff(r: dict) -> list[str]:
    h, s = r["handoff"], r.get("save_load")
    one = h["one_gpu"]
    lines = [
        "",
        f"Same-node handoff (`--handoff`, {one['blocks']} blocks, {one['order']}; per round "
        "the producer's publish + the consumer's lookup and scatter, two processes, the "
        "ring mapped over CUDA IPC; ratios per round, median [range]):",
        "",
        "| handoff | GB/s | against | GB/s | ratio | target |",
        "|---|---|---|---|---|---|",
        f"| 2 processes on GPU 0 | {one['handoff_GBps']:.1f} | device-to-device copy on GPU 0 "
        f"(one pass; the handoff makes two) | {one['copy_GBps']:.1f} | "
        f"{_ratio(one['ratio'])} [{_ratio(one['ratio_range'][0])}-{_ratio(one['ratio_range'][1])}]"
        " | (one GPU: no target) |",
    ]
    if s:
        host = s["save_s"] + s["load_s"]
        lines.append(
            f"| 2 processes on GPU 0 | {one['handoff_GBps']:.1f} | the host path (save + "
            f"load, medians above) | {s['kv_bytes'] / host / 1e9:.1f} | "
            f"{_ratio(host / one['handoff_s'])}x faster | |"
        )
    two = h.get("two_gpus")
    if two:
        lines.append(
            f"| GPU 0 -> GPU 1 | {two['handoff_GBps']:.1f} | peer copy | "
            f"{two['copy_GBps']:.1f} | {_ratio(two['ratio'])} | >= 0.8 |"
        )
    else:
        lines.append(f"| GPU 0 -> GPU 1 | skipped: {h.get('two_gpus_skipped')} | | | | >= 0.8 |")
    lines += [
        "",
        f"handoff bit-exact: {one.get('bit_exact')}"
        + (f" (two GPUs: {two.get('bit_exact')})" if two else "")
        + f"; rings after: {one.get('rings_after')}",
    ]
    return lines


HYBRID = {
    "gemma3": {
        "layers": 8,
        "sliding": 5,
        "window": 1024,
        "attention": {"heads": 8, "block_size": 16, "head_dim": 256},
    },
    "qwen3next": {
        "layers": 12,
        "state": 3,
        "attention": {"heads": 2, "block_size": 544, "head_dim": 256},
        "state_shapes": ((3, 8192), (32, 128, 128)),
        "state_dtypes": ("bfloat16", "bfloat16"),
    },
}


def hybrid_model(name: str, layers: int | None = None):
    """``(pool shapes, vLLM groups)`` of hybrid shape ``name`` (see the module docstring);
    ``layers``: per group, instead of the shape's (a smaller smoke run)."""
    from kvbroker.integrations.vllm._groups import FULL, SLIDING, STATE, Group

    spec = HYBRID[name]
    att = spec["attention"]
    L = layers or spec["layers"]
    kinds = [SLIDING] * spec.get("sliding", 0) + [STATE] * spec.get("state", 0) + [FULL]
    shapes, groups = [], []
    for i, kind in enumerate(kinds):
        names = tuple(f"g{i}.l{layer}" for layer in range(L))
        if kind == STATE:
            shape = StateGroupShape(L, spec["state_shapes"], spec["state_dtypes"])
            shapes.append(shape)
            page = AttentionGroupShape(L, **att).page_nbytes()
            groups.append(
                Group(
                    i,
                    STATE,
                    att["block_size"],
                    names,
                    state_shapes=shape.shapes,
                    state_dtypes=shape.dtypes,
                    page_nbytes=page,
                )
            )
        else:
            shapes.append(AttentionGroupShape(L, **att))
            groups.append(
                Group(
                    i,
                    kind,
                    att["block_size"],
                    names,
                    "bfloat16",
                    att["heads"],
                    att["head_dim"],
                    window=spec["window"] if kind == SLIDING else None,
                )
            )
    return shapes, groups


def bench_hybrid(a, device) -> dict:
    """One step's save of a 16k-token prompt's blocks of every group, and the load of the
    hit, through the hybrid worker; against pinned copies of the same bytes, per round."""
    from kvbroker.integrations.vllm._format import prompt_keys
    from kvbroker.integrations.vllm._groups import SLIDING, STATE
    from kvbroker.integrations.vllm._hybrid import GroupLoad, GroupSave, HybridLoad
    from kvbroker.integrations.vllm._hybrid_worker import HybridWorker
    from kvbroker.integrations._link import BrokerLink, Warnings
    from kvbroker.integrations.vllm._scheduler import StepPlan

    shapes, groups = hybrid_model(a.hybrid, a.layers)
    bs = groups[0].block_size
    nblk = max(1, a.tokens // bs)
    hit = nblk * bs
    # engine blocks: each group's saved run, then each group's loaded blocks (a block id is
    # one group's at a time); block 0 is vLLM's null block
    first_load = {g.index: (g.first_needed(hit) if g.kind == SLIDING else 0) for g in groups}
    next_id, src, dst = 1, {}, {}
    for g in groups:
        count = 1 if g.kind == STATE else nblk
        src[g.index] = list(range(next_id, next_id + count))
        next_id += count
    for g in groups:
        count = 1 if g.kind == STATE else nblk - first_load[g.index]
        dst[g.index] = list(range(next_id, next_id + count))[::-1]  # scattered the other way
        next_id += count
    caches, raw = hybrid_pool(shapes, next_id, device, a.order)
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    L = shapes[0].layers
    # the daemon's pages are 2 MiB: a block takes whole pages
    pages_2m = sum(
        len(src[g.index])
        * -(-(L * (s.content_nbytes() if g.kind == STATE else s.page_nbytes())) // (2 << 20))
        for g, s in zip(groups, shapes, strict=True)
    )
    proc = start_daemon(sock, 2 * pages_2m + 512)
    worker = None
    try:
        from kvbroker.integrations.vllm._paged import copier_for

        link = BrokerLink(sock, name="bench-hybrid", role="kv_both", map_pools=True, timeout=60)
        worker = HybridWorker(
            groups=groups,
            link=link,
            namespace=NS,
            block_size=bs,
            tp_rank=0,
            tp_size=1,
            warnings=Warnings(),
            staging_copier=copier_for("cpu") if device.type == "cpu" else None,
        )
        worker.register(caches, "FLASH_ATTN")
        fmts = worker.formats
        save_bytes = sum(fmts[g.index].block_nbytes * len(src[g.index]) for g in groups)
        load_bytes = sum(fmts[g.index].block_nbytes * len(dst[g.index]) for g in groups)
        res: dict = {
            "shape": a.hybrid,
            "tokens": hit,
            "order": a.order,
            "block_size": bs,
            "groups": [f"{g.kind} x{len(g.layer_names)} layers" for g in groups],
            "save_blocks": sum(len(v) for v in src.values()),
            "load_blocks": sum(len(v) for v in dst.values()),
            "save_bytes": save_bytes,
            "load_bytes": load_bytes,
            "state_page_bytes": sum(
                f.block_nbytes
                for g, f in zip(groups, fmts.values(), strict=True)
                if g.kind == STATE
            ),
        }
        cuda = device.type == "cuda"
        if cuda:
            big = max(save_bytes, load_bytes)
            dev_buf = torch.empty(big, dtype=torch.uint8, device=device)
            host_buf = torch.empty(big, dtype=torch.uint8, pin_memory=True)
        client = link.get()
        stream = worker._gpu_client(client).stream if cuda else None
        rows: list[dict] = []
        for rep in range(a.reps + 1):
            salt = f"r{rep}"
            keys = prompt_keys(list(range(hit + 1)), bs, namespace=NS, cache_salt=salt)
            saves = []
            for g in groups:
                k = [g.key(h) for h in keys.hashes[:nblk]]
                if g.kind == STATE:
                    saves.append(GroupSave("r", g.index, [(k[-1], None, src[g.index][0])]))
                else:
                    saves.append(
                        GroupSave(
                            "r",
                            g.index,
                            [
                                (k[i], k[i - 1] if i else None, b)
                                for i, b in enumerate(src[g.index])
                            ],
                        )
                    )
            loads = []
            for g in groups:
                k = [g.key(h) for h in keys.hashes[:nblk]]
                k = k[-1:] if g.kind == STATE else k[first_load[g.index] :]
                loads.append(GroupLoad(g.index, k, dst[g.index]))
            row: dict = {}
            if cuda:
                row["pinned_d2h_s"] = events_median(
                    lambda: host_buf[:save_bytes].copy_(dev_buf[:save_bytes], non_blocking=True), 1
                )
            before = worker.stats["saved_blocks"]
            sync(device)
            t0 = time.perf_counter()
            worker.bind(StepPlan(saves=saves))
            worker.wait_for_save()
            worker.unbind()
            sync(device)
            row["save_s"] = time.perf_counter() - t0
            saved = worker.stats["saved_blocks"] - before
            if cuda:
                row["pinned_h2d_s"] = events_median(
                    lambda: dev_buf[:load_bytes].copy_(host_buf[:load_bytes], non_blocking=True), 1
                )
            spec = HybridLoad("q", loads, hit - 1)
            sync(device)
            t0 = time.perf_counter()
            got = worker._copy_in(spec, client, stream)  # what the loader thread runs
            sync(device)
            row["load_s"] = time.perf_counter() - t0
            assert saved == res["save_blocks"] and got == res["load_blocks"], (rep, saved, got)
            if rep == 0:  # warm-up: check the bytes of every group
                ok = True
                for g in groups:
                    pairs = list(
                        zip(
                            src[g.index][first_load[g.index] :]
                            if g.kind != STATE
                            else src[g.index],
                            dst[g.index],
                            strict=True,
                        )
                    )
                    for name in g.layer_names[:: max(1, L // 4)]:
                        t = caches[name]
                        for s_id, d_id in pairs[:: max(1, len(pairs) // 16)]:
                            ok = ok and torch.equal(
                                t[s_id].view(torch.uint8)
                                if t.dtype == torch.int8
                                else t[s_id].view(torch.int16),
                                t[d_id].view(torch.uint8)
                                if t.dtype == torch.int8
                                else t[d_id].view(torch.int16),
                            )
                res["bit_exact"] = bool(ok)
            else:
                rows.append(row)
            client.evict(namespace=NS)
        res["save_s"] = statistics.median(r["save_s"] for r in rows)
        res["load_s"] = statistics.median(r["load_s"] for r in rows)
        res["save_GBps"] = save_bytes / res["save_s"] / 1e9
        res["load_GBps"] = load_bytes / res["load_s"] / 1e9
        if cuda:
            res["save_vs_pinned"] = [r["pinned_d2h_s"] / r["save_s"] for r in rows]
            res["load_vs_pinned"] = [r["pinned_h2d_s"] / r["load_s"] for r in rows]
            res["pinned_d2h_GBps"] = (
                save_bytes / statistics.median(r["pinned_d2h_s"] for r in rows) / 1e9
            )
            res["pinned_h2d_GBps"] = (
                load_bytes / statistics.median(r["pinned_h2d_s"] for r in rows) / 1e9
            )
        res["rounds"] = rows
        res["skipped_save_blocks"] = worker.stats["skipped_save_blocks"]
    finally:
        if worker is not None:
            worker.close()
        proc.terminate()
        proc.wait(30)
    del raw
    return res


def markdown_hybrid(r: dict) -> str:
    from kvbroker._bench._common import ratio_span

    h = r["hybrid"]
    lines = [
        f"# vLLM connector, hybrid {h['shape']} cache, on {r['machine']['device']}",
        "",
        f"commit {r['commit']}, {r['when']}; `{r['command']}`",
        "",
        f"{h['tokens']} tokens, block {h['block_size']}, groups: {', '.join(h['groups'])}; "
        f"{h['order']} attention pages, bf16; save {h['save_blocks']} blocks "
        f"({h['save_bytes'] / 2**20:.1f} MiB), load {h['load_blocks']} blocks "
        f"({h['load_bytes'] / 2**20:.1f} MiB); medians of {r['reps']} rounds.",
        "",
        "| path | GB/s | pinned GB/s | ratio per round: median (range) | target |",
        "|---|---|---|---|---|",
    ]
    if "save_vs_pinned" in h:
        lines.append(
            f"| save (wait_for_save, every group) | {h['save_GBps']:.1f} | D2H "
            f"{h['pinned_d2h_GBps']:.1f} | {ratio_span(h['save_vs_pinned'])} | >= 0.8 |"
        )
        lines.append(
            f"| load (every group of the hit) | {h['load_GBps']:.1f} | H2D "
            f"{h['pinned_h2d_GBps']:.1f} | {ratio_span(h['load_vs_pinned'])} | >= 0.8 |"
        )
    else:
        lines.append(f"| save | {h['save_GBps']:.2f} | (CPU run) | | |")
        lines.append(f"| load | {h['load_GBps']:.2f} | (CPU run) | | |")
    c = r["conditions"]
    lines += [
        "",
        f"bit-exact: {h.get('bit_exact')}; saves skipped: {h['skipped_save_blocks']}; "
        f"load average {c['before']['loadavg_1min']} -> {c['after']['loadavg_1min']}, "
        f"CPU pressure `{c['before']['cpu_pressure']}` -> `{c['after']['cpu_pressure']}`",
    ]
    return "\n".join(lines) + "\n"


def markdown(r: dict) -> str:
    if "hybrid" in r:
        return markdown_hybrid(r)
    s = r["save_load"]
    lines = [
        f"# vLLM connector worker path on {r['machine']['device']}",
        "",
        f"commit {r['commit']}, {r['when']}; `{r['command']}`",
        "",
        f"{s['tokens']} tokens, {s['blocks']} blocks of {s['block_bytes']} B "
        f"({_ratio(s['kv_bytes'] / 2**30)} GiB), {s['order']} cache, bf16; medians of "
        f"{r['reps']}.",
        "",
        "| path | GB/s | vs | ratio | target |",
        "|---|---|---|---|---|",
    ]
    p = r.get("pinned")
    if p:
        lines.append(
            f"| save (whole call) | {s['save_GBps']:.1f} | pinned D2H "
            f"{p['pinned_d2h_GBps']:.1f} | {_ratio(s['save_GBps'] / p['pinned_d2h_GBps'])} "
            f"| >= 0.8 |"
        )
        lines.append(
            f"| load (whole call) | {s['load_GBps']:.1f} | pinned H2D "
            f"{p['pinned_h2d_GBps']:.1f} | {_ratio(s['load_GBps'] / p['pinned_h2d_GBps'])} "
            f"| >= 0.8 |"
        )
    else:
        lines.append(f"| save | {s['save_GBps']:.2f} | (CPU run) | | |")
        lines.append(f"| load | {s['load_GBps']:.2f} | (CPU run) | | |")
    ring = r.get("ring")
    if ring:
        lines.append(
            f"| GPU0 -> GPU1 via ring | {ring['ring_handoff_GBps']:.1f} | peer copy "
            f"{ring['peer_copy_GBps']:.1f} | "
            f"{_ratio(ring['ring_handoff_GBps'] / ring['peer_copy_GBps'])} | >= 0.7 |"
        )
    else:
        lines.append(f"| GPU0 -> GPU1 via ring | skipped: {r.get('ring_skipped', '')} | | | |")
    lines += [
        "",
        f"bit-exact: save/load {s.get('bit_exact')}"
        + (f", ring {ring.get('bit_exact')}" if ring else ""),
    ]
    if "handoff" in r:
        lines += markdown_handoff(r)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="vllm-gpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers (default 32); with --hybrid, layers per group (default the shape's)",
    )
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--order", choices=("NHD", "HND"), default="NHD")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, memmove for the DMA")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: as --cpu")
    ap.add_argument(
        "--hybrid", choices=sorted(HYBRID), help="a hybrid model's cache (see the module docstring)"
    )
    ap.add_argument(
        "--handoff",
        action="store_true",
        help="also the connector's same-node handoff through a GPU ring",
    )
    ap.add_argument(
        "--commit", help="the commit measured, where the checkout has no usable git (a copied tree)"
    )
    a = ap.parse_args()
    a.cpu = a.cpu or a.device == "cpu"
    if a.layers is None and not a.hybrid:
        a.layers = 32
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    r: dict = {
        "commit": a.commit or os.environ.get("KVBROKER_COMMIT") or checkout_commit(ROOT),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(
            shlex.quote(x)
            for x in [os.path.relpath(sys.executable, ROOT) if False else "python", *sys.argv]
        ),
        "machine": {
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": (torch.cuda.get_device_name(0) if not a.cpu else "CPU"),
            "gpus": torch.cuda.device_count() if not a.cpu else 0,
        },
        "reps": a.reps,
        "conditions": {"before": run_conditions()},
    }
    if a.hybrid:
        r["hybrid"] = bench_hybrid(a, device)
        r["conditions"]["after"] = run_conditions()
        print("hybrid", {k: v for k, v in r["hybrid"].items() if k != "rounds"}, flush=True)
        _write(a, r)
        return
    if not a.cpu:
        r["pinned"] = bench_pinned(a.tokens * a.layers * 2 * a.heads * a.head_dim * 2, a.reps)
        print("pinned", r["pinned"], flush=True)
    r["save_load"] = bench_save_load(a, device)
    print("save/load", r["save_load"], flush=True)
    if not a.cpu and torch.cuda.device_count() >= 2:
        r["ring"] = bench_ring(a)
        print("ring", r["ring"], flush=True)
    else:
        r["ring_skipped"] = (
            "CPU run"
            if a.cpu
            else f"{torch.cuda.device_count()} GPU visible, the ring handoff needs 2"
        )
        print("ring handoff skipped:", r["ring_skipped"], flush=True)
    if a.handoff and not a.cpu:
        r["handoff"] = bench_handoffs(a)
    r["conditions"]["after"] = run_conditions()
    _write(a, r)


def _write(a, r: dict) -> None:
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(r, f, indent=2)
    md = markdown(r)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
