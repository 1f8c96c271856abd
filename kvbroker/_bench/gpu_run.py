"""GPU data path benchmark, in one run on a CUDA host; writes JSON and markdown.

Side by side, in the same process and run:
- pinned-memory D2H / H2D bandwidth (1 GiB, CUDA events, median);
- kvbroker publish (D2H) and claim (H2D) of 1 GiB through a cudaHostRegister'ed pool of a
  daemon this script starts (wall time of the whole call: reserve, DMA, seal / claim, DMA,
  release), target >= 0.9 x pinned;
- gather / scatter kernels (Triton) against a device-to-device copy of the same bytes and
  torch's index-based fallback, bytes read + written, target >= 0.8 x D2D and >= 2 x torch;
- GPU0 -> GPU1 handoff through the daemon's ring (``ring_publish`` on GPU 0, ``ring_claim`` on
  GPU 1: one peer copy) against torch's peer copy of the same bytes, target >= 0.8 x;
- the heterogeneous claim (1k tokens, 64 layers, P=4 -> D=1): copy operations and time of
  ``gpu.claim_shards_cuda`` against the per-token path (one copy per token, layer, K/V, head);
- optionally the CUDA tests (``--pytest``).

Part of the installed package (``kvbroker bench gpu`` runs it as
``python -m kvbroker._bench.gpu_run``); in a checkout ``python benchmarks/bench_gpu.py --out DIR
[--pytest] [--name gpu]`` does the same (``--pytest`` needs the checkout's tests/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

from kvbroker import Client, gpu
from kvbroker._client import kernels as _kernels
from .gpu_report import markdown


GiB = 1 << 30


def events_median(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall_median(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_pinned(nbytes: int, reps: int) -> dict:
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = events_median(partial(host.copy_, dev, non_blocking=True), reps)
    h2d = events_median(partial(dev.copy_, host, non_blocking=True), reps)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    d2h_pageable = events_median(partial(pageable.copy_, dev, non_blocking=True), 3)
    del dev, host, pageable
    return {
        "pinned_d2h_GBps": nbytes / d2h / 1e9,
        "pinned_h2d_GBps": nbytes / h2d / 1e9,
        "pageable_d2h_GBps": nbytes / d2h_pageable / 1e9,
    }


def start_daemon(sock: str, pool_size: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--socket",
            sock,
            "--pool-size",
            pool_size,
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
        except Exception:
            time.sleep(0.05)
    raise RuntimeError("daemon not ready")


def bench_broker(nbytes: int, reps: int) -> dict:
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    proc = start_daemon(sock, f"{(nbytes + (256 << 20)) >> 20}M")
    res: dict = {}
    try:
        t0 = time.perf_counter()
        client = Client(sock)
        res["map_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = gpu.GpuClient(client, own_client=True)
        res["register_s"] = time.perf_counter() - t0
        with g:
            # 64 layers x K/V of 8 MiB each = 1 GiB in 128 buffers: one DMA per buffer
            n = 128
            src = torch.randint(0, 256, (n, nbytes // n), dtype=torch.uint8, device="cuda")
            tensors = {
                f"past_key.{i // 2}" if i % 2 == 0 else f"past_value.{i // 2}": src[i]
                for i in range(n)
            }
            out = {k: torch.empty_like(v) for k, v in tensors.items()}
            one_src, one_out = {"kv": src.view(-1)}, {"kv": torch.empty_like(src.view(-1))}
            # the same 128 buffers as separate allocations: no two adjacent, 128 DMAs each way
            apart = {
                k: torch.empty(v.numel() + 4096, dtype=torch.uint8, device="cuda")[4096:]
                for k, v in tensors.items()
            }
            for k, v in apart.items():
                v.copy_(tensors[k])
            apart_out = {
                k: torch.empty(v.numel() + 4096, dtype=torch.uint8, device="cuda")[4096:]
                for k, v in apart.items()
            }
            counter = iter(range(10**6))
            copies: dict = {}

            def cycle(ts, os_, pub_times, claim_times):
                key = f"k{next(counter)}"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g.publish(key, ts)
                copies["publish"] = g.last_copies
                t1 = time.perf_counter()
                g.claim(key, os_, consume=True)
                copies["claim"] = g.last_copies
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                pub_times.append(t1 - t0)
                claim_times.append(t2 - t1)

            cases = (
                ("one_buffer", one_src, one_out),
                ("128_buffers", tensors, out),
                ("128_separate", apart, apart_out),
            )
            for label, ts, os_ in cases:
                pubs, claims = [], []
                cycle(ts, os_, [], [])  # warm-up
                for _ in range(reps):
                    cycle(ts, os_, pubs, claims)
                res[f"publish_d2h_{label}_GBps"] = nbytes / statistics.median(pubs) / 1e9
                res[f"claim_h2d_{label}_GBps"] = nbytes / statistics.median(claims) / 1e9
                res[f"copies_{label}"] = f"{copies['publish']}/{copies['claim']}"
            ok = all(torch.equal(out[k], tensors[k]) for k in tensors)
            ok = ok and all(torch.equal(apart_out[k], tensors[k]) for k in tensors)
            ok = ok and torch.equal(one_out["kv"], one_src["kv"])
            res["bit_exact"] = bool(ok)
            # the DMA alone into the registered pool (no RPC): one lease, CUDA events
            with client.reserve("raw", {"b": nbytes}) as lease:
                view = gpu.host_tensors(lease)["b"]
                flat = src.view(-1)
                res["registered_d2h_GBps"] = (
                    nbytes / events_median(partial(view.copy_, flat, non_blocking=True), reps) / 1e9
                )
                res["registered_h2d_GBps"] = (
                    nbytes / events_median(partial(flat.copy_, view, non_blocking=True), reps) / 1e9
                )
                del view
            del src, tensors, out, one_src, one_out, apart, apart_out
    finally:
        proc.terminate()
        proc.wait(30)
    return res


def bench_kernels(reps: int) -> dict:
    from triton.testing import do_bench

    L, C, P, H, D = 32, 2, 16, 8, 128
    tokens, h0, nh = 8192, 2, 4
    blocks = tokens // P + 64
    dtype = torch.bfloat16
    cache = torch.randint(
        -(2**15), 2**15, (L, C, blocks, P, H, D), dtype=torch.int16, device="cuda"
    ).view(dtype)
    table = torch.randperm(blocks, device="cuda")[: tokens // P].to(torch.int32)
    staging = torch.empty((L, C, nh, tokens, D), dtype=dtype, device="cuda")
    moved = staging.numel() * staging.element_size() * 2  # read + written
    res: dict = {
        "shape": {
            "layers": L,
            "kv": C,
            "page": P,
            "heads": H,
            "head_dim": D,
            "tokens": tokens,
            "head_range": [h0, h0 + nh],
            "dtype": str(dtype),
            "bytes_read_plus_written": moved,
        }
    }

    def ms(fn):
        return do_bench(fn, warmup=50, rep=max(100, reps * 20), return_mode="median") / 1e3

    src = torch.empty_like(staging)
    dst = torch.empty_like(staging)
    res["d2d_copy_GBps"] = moved / ms(lambda: dst.copy_(src)) / 1e9
    contiguous_blocks = cache[:, :, : tokens // P]
    res["torch_strided_copy_GBps"] = (
        moved
        / ms(
            lambda: staging.view(L, C, nh, tokens // P, P, D).copy_(
                contiguous_blocks[:, :, :, :, h0 : h0 + nh].permute(0, 1, 4, 2, 3, 5)
            )
        )
        / 1e9
    )
    res["torch_gather_GBps"] = (
        moved
        / ms(lambda: _kernels.gather(cache, table, tokens, staging, head_start=h0, backend="torch"))
        / 1e9
    )
    res["torch_scatter_GBps"] = (
        moved
        / ms(
            lambda: _kernels.scatter(staging, cache, table, tokens, head_start=h0, backend="torch")
        )
        / 1e9
    )
    # correctness on this data, then the tile sweep
    ref = torch.empty_like(staging)
    _kernels.gather(cache, table, tokens, ref, head_start=h0, backend="torch")
    _kernels.gather(cache, table, tokens, staging, head_start=h0, backend="triton")
    res["gather_bit_exact"] = bool(torch.equal(ref.view(torch.int16), staging.view(torch.int16)))
    sweep = []
    for tile in (4096, 8192, 16384, 32768, 65536):
        for warps in (4, 8, 16):
            _kernels.TILE_BYTES, _kernels.NUM_WARPS = tile, warps
            g = (
                moved
                / ms(
                    lambda: _kernels.gather(
                        cache, table, tokens, staging, head_start=h0, backend="triton"
                    )
                )
                / 1e9
            )
            s = (
                moved
                / ms(
                    lambda: _kernels.scatter(
                        staging, cache, table, tokens, head_start=h0, backend="triton"
                    )
                )
                / 1e9
            )
            sweep.append(
                {"tile_bytes": tile, "num_warps": warps, "gather_GBps": g, "scatter_GBps": s}
            )
    res["triton_sweep"] = sweep
    best_g = max(sweep, key=lambda r: r["gather_GBps"])
    best_s = max(sweep, key=lambda r: r["scatter_GBps"])
    res["triton_gather_GBps"] = best_g["gather_GBps"]
    res["triton_scatter_GBps"] = best_s["scatter_GBps"]
    res["triton_gather_default_GBps"] = next(
        r["gather_GBps"] for r in sweep if (r["tile_bytes"], r["num_warps"]) == (16384, 4)
    )
    res["best_gather_config"] = [best_g["tile_bytes"], best_g["num_warps"]]
    res["best_scatter_config"] = [best_s["tile_bytes"], best_s["num_warps"]]
    return res


def bench_rings(nbytes: int, reps: int) -> dict:
    """GPU0 -> GPU1 through the daemon's ring, against torch's peer copy, same run."""
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    ring = f"{(nbytes + (64 << 20)) >> 20}M"
    proc = start_daemon(sock, "256M", "--gpu-ring", ring)
    res: dict = {"nbytes": nbytes, "ring_size": ring}
    try:
        a0 = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
        b1 = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        res["peer_access"] = bool(torch.cuda.can_device_access_peer(1, 0))
        res["peer_copy_GBps"] = nbytes / events_median(partial(b1.copy_, a0), reps) / 1e9
        with (
            gpu.GpuClient(Client(sock), own_client=True, device="cuda:0") as prefill,
            gpu.GpuClient(Client(sock), own_client=True, device="cuda:1") as decode,
        ):
            res["rings"] = prefill.rings()
            counter = iter(range(10**6))
            pubs, claims, ends = [], [], []
            for i in range(reps + 1):
                key = f"h{next(counter)}"
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
                prefill.ring_publish(key, {"kv": a0})
                t1 = time.perf_counter()
                decode.ring_claim(key, {"kv": b1})
                torch.cuda.synchronize(1)
                t2 = time.perf_counter()
                if i:  # the first one maps the ring and enables peer access
                    pubs.append(t1 - t0)
                    claims.append(t2 - t1)
                    ends.append(t2 - t0)
            res["claim_copies"] = decode.last_copies
            # The producer writes straight into a reserved ring region (a prefill's layout
            # gather does: gpu.publish_shard_cuda's staging), so publishing is reserve + seal.
            zc = []
            for i in range(reps + 1):
                key = f"z{next(counter)}"
                torch.cuda.synchronize(0)
                t0 = time.perf_counter()
                region = prefill.ring_reserve(
                    nbytes, key=key, meta={"buffers": {"kv": [0, nbytes, "uint8", [nbytes]]}}
                )
                t1 = time.perf_counter()
                region.tensor.copy_(a0)  # stands for the producer's own write (not timed)
                torch.cuda.synchronize(0)
                t2 = time.perf_counter()
                region.seal()
                decode.ring_claim(key, {"kv": b1})
                torch.cuda.synchronize(1)
                t3 = time.perf_counter()
                if i:
                    zc.append((t1 - t0) + (t3 - t2))
            res["ring_zero_copy_handoff_GBps"] = nbytes / statistics.median(zc) / 1e9
            res["zero_copy_bit_exact"] = bool(torch.equal(b1, a0.to("cuda:1")))
            res["bit_exact"] = bool(torch.equal(b1, a0.to("cuda:1")))
            res["ring_claim_GBps"] = nbytes / statistics.median(claims) / 1e9
            res["ring_publish_d2d_GBps"] = nbytes / statistics.median(pubs) / 1e9
            res["ring_end_to_end_GBps"] = nbytes / statistics.median(ends) / 1e9
            res["ring_stat_after"] = decode.client.stat().rings
        del a0, b1
    finally:
        proc.terminate()
        proc.wait(30)
    return res


def bench_hetero(reps: int, per_token: bool = True) -> dict:
    """1k tokens, 64 layers, 8 KV heads, P=4 -> D=1: kernel path vs the per-token path."""
    import ctypes

    L, H, D, page, tokens, P = 64, 8, 128, 16, 1024, 4
    dtype = torch.bfloat16
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    proc = start_daemon(sock, "1G", "--gpu-ring", "1G")
    res: dict = {
        "shape": {
            "layers": L,
            "kv_heads": H,
            "head_dim": D,
            "page": page,
            "tokens": tokens,
            "prefill_tp": P,
            "decode_tp": 1,
            "dtype": str(dtype),
        }
    }
    try:
        blocks = tokens // page + 8
        with gpu.GpuClient(Client(sock), own_client=True) as g:
            full = torch.randint(
                -(2**15), 2**15, (L, 2, blocks, page, H, D), dtype=torch.int16, device="cuda"
            ).view(dtype)
            table = torch.randperm(blocks, device="cuda")[: tokens // page]
            pubs = []
            for p in range(P):
                shard = full[:, :, :, :, 2 * p : 2 * p + 2].contiguous()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = gpu.publish_shard_cuda(
                    g,
                    "req",
                    shard,
                    table,
                    tokens,
                    tp_rank=p,
                    tp_size=P,
                    total_kv_heads=H,
                    decode_tp_size=1,
                )
                pubs.append(time.perf_counter() - t0)
                res["publish_copy_ops_per_shard"] = r.copy_ops
                del shard
            res["publish_s_per_shard"] = statistics.median(pubs)
            res["shard_bytes"] = r.nbytes
            dec = torch.zeros_like(full)
            dtable = torch.randperm(blocks, device="cuda")[: tokens // page]
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                c = gpu.claim_shards_cuda(
                    g,
                    "req",
                    dec,
                    dtable,
                    tp_rank=0,
                    tp_size=1,
                    prefill_tp_size=P,
                    total_kv_heads=H,
                    consume=False,
                )
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res["kernel_path_copy_ops"] = c.copy_ops
            res["kernel_path_s"] = statistics.median(times)
            t = torch.arange(tokens, device="cuda")
            want = full[:, :, table[t // page], t % page].view(torch.int16)
            res["kernel_path_bit_exact"] = bool(
                torch.equal(dec[:, :, dtable[t // page], t % page].view(torch.int16), want)
            )
            if per_token:
                # The seed's path: one H2D copy per (token, layer, K/V, head) straight from the
                # pool into the decode cache's slot (heads are outermost in a stored buffer, so
                # one token's heads are not adjacent there).
                lib = gpu._driver()
                dec2 = torch.zeros_like(full)
                item = dec2.element_size()
                st = [x * item for x in dec2.stride()]
                base = dec2.data_ptr()
                dt = dtable.tolist()
                copy = lib.cuMemcpyAsync
                stream = ctypes.c_void_p(g.stream.cuda_stream)
                row = D * item
                leases = [g.client.claim(f"req/tp{p}of{P}") for p in range(P)]
                ops = 0
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.cuda.device(0):
                    for p, lease in enumerate(leases):
                        addrs = gpu._host_addresses(lease)
                        for layer in range(L):
                            for kind, c_ in (("key", 0), ("value", 1)):
                                src0 = addrs[f"past_{kind}.{layer}"]
                                dl = base + layer * st[0] + c_ * st[1]
                                for h in range(2):
                                    sh = src0 + h * tokens * row
                                    dh = dl + (2 * p + h) * st[4]
                                    for tok in range(tokens):
                                        copy(
                                            dh + dt[tok // page] * st[2] + (tok % page) * st[3],
                                            sh + tok * row,
                                            row,
                                            stream,
                                        )
                                        ops += 1
                g.stream.synchronize()
                res["per_token_s"] = time.perf_counter() - t0
                res["per_token_copy_ops"] = ops
                for lease in leases:
                    lease.release()
                res["per_token_bit_exact"] = bool(
                    torch.equal(dec2[:, :, dtable[t // page], t % page].view(torch.int16), want)
                )
                res["speedup"] = res["per_token_s"] / res["kernel_path_s"]
            del full, dec
    finally:
        proc.terminate()
        proc.wait(30)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pytest", action="store_true")
    ap.add_argument("--name", default="gpu", help="output file stem")
    ap.add_argument(
        "--commit",
        default=None,
        help="the commit measured (a copied tree without git; default: the checkout's)",
    )
    ap.add_argument(
        "--skip", default="", help="comma list of: broker,kernels,rings,hetero,per_token"
    )
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    import triton

    os.makedirs(a.out, exist_ok=True)
    from ._common import invocation, measured_commit

    r: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": a.commit or measured_commit(),
        "command": invocation(),
    }
    r["pinned"] = bench_pinned(GiB, a.reps)
    print("pinned", r["pinned"], flush=True)
    import traceback

    def section(name, fn):
        if name in skip:
            return
        try:
            r[name] = fn()
        except Exception as exc:  # keep the other figures of this run
            r[name + "_error"] = traceback.format_exc()
            print(name, "failed:", exc, flush=True)
        torch.cuda.empty_cache()
        print(name, {k: v for k, v in r.get(name, {}).items() if k != "triton_sweep"}, flush=True)

    section("broker", lambda: bench_broker(GiB, a.reps))
    section("kernels", lambda: bench_kernels(a.reps))
    if torch.cuda.device_count() >= 2:
        section("rings", lambda: bench_rings(GiB, a.reps))
    section("hetero", lambda: bench_hetero(a.reps, per_token="per_token" not in skip))
    if a.pytest:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_kernels.py",
                "tests/test_gpu.py",
                "tests/test_gpu_ring.py",
                "tests/test_ring.py",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        tail = p.stdout.strip().splitlines()
        r["pytest"] = {"rc": p.returncode, "summary": tail[-1] if tail else p.stderr[-300:]}
        with open(os.path.join(a.out, "pytest.txt"), "w") as f:
            f.write(p.stdout + p.stderr)
        print(p.stdout[-3000:], p.stderr[-2000:], flush=True)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(r, f, indent=2)
    try:
        md = markdown(r)
    except Exception:
        md = "```\n" + traceback.format_exc() + "\n```\n" + json.dumps(r, indent=1)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
