"""GPU data path benchmark, in one run on a CUDA host; writes JSON and markdown.

Side by side, in the same process and run:
- pinned-memory D2H / H2D bandwidth (1 GiB, CUDA events, median);
- kvbroker publish (D2H) and claim (H2D) of 1 GiB through a cudaHostRegister'ed pool of a
  daemon this script starts (wall time of the whole call: reserve, DMA, seal / claim, DMA,
  release), target >= 0.9 x pinned;
- gather / scatter kernels (Triton) against a device-to-device copy of the same bytes and
  torch's index-based fallback, bytes read + written, target >= 0.8 x D2D and >= 2 x torch;
- optionally the CUDA tests (``--pytest``).

Usage: ``python benchmarks/bench_gpu.py --out DIR [--pytest]``.
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvbroker import Client, _kernels, gpu  # noqa: E402

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
    d2h = events_median(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = events_median(lambda: dev.copy_(host, non_blocking=True), reps)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    d2h_pageable = events_median(lambda: pageable.copy_(dev, non_blocking=True), 3)
    del dev, host, pageable
    return {"pinned_d2h_GBps": nbytes / d2h / 1e9, "pinned_h2d_GBps": nbytes / h2d / 1e9,
            "pageable_d2h_GBps": nbytes / d2h_pageable / 1e9}  # fmt: skip


def start_daemon(sock: str, pool_size: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbroker", "serve", "--socket", sock, "--pool-size", pool_size,
         "--page-size", "2M", "--log-level", "warning"],
    )  # fmt: skip
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
            tensors = {f"past_key.{i // 2}" if i % 2 == 0 else f"past_value.{i // 2}": src[i]
                       for i in range(n)}  # fmt: skip
            out = {k: torch.empty_like(v) for k, v in tensors.items()}
            one_src, one_out = {"kv": src.view(-1)}, {"kv": torch.empty_like(src.view(-1))}
            counter = iter(range(10**6))

            def cycle(ts, os_, pub_times, claim_times):
                key = f"k{next(counter)}"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g.publish(key, ts)
                t1 = time.perf_counter()
                g.claim(key, os_, consume=True)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                pub_times.append(t1 - t0)
                claim_times.append(t2 - t1)

            for label, ts, os_ in (("one_buffer", one_src, one_out), ("128_buffers", tensors, out)):
                pubs, claims = [], []
                cycle(ts, os_, [], [])  # warm-up
                for _ in range(reps):
                    cycle(ts, os_, pubs, claims)
                res[f"publish_d2h_{label}_GBps"] = nbytes / statistics.median(pubs) / 1e9
                res[f"claim_h2d_{label}_GBps"] = nbytes / statistics.median(claims) / 1e9
            ok = all(torch.equal(out[k], tensors[k]) for k in tensors)
            ok = ok and torch.equal(one_out["kv"], one_src["kv"])
            res["bit_exact"] = bool(ok)
            # the DMA alone into the registered pool (no RPC): one lease, CUDA events
            with client.reserve("raw", {"b": nbytes}) as lease:
                view = gpu.host_tensors(lease)["b"]
                flat = src.view(-1)
                res["registered_d2h_GBps"] = nbytes / events_median(
                    lambda: view.copy_(flat, non_blocking=True), reps) / 1e9
                res["registered_h2d_GBps"] = nbytes / events_median(
                    lambda: flat.copy_(view, non_blocking=True), reps) / 1e9
                del view
            del src, tensors, out, one_src, one_out
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
    cache = torch.randint(-(2**15), 2**15, (L, C, blocks, P, H, D), dtype=torch.int16,
                          device="cuda").view(dtype)  # fmt: skip
    table = torch.randperm(blocks, device="cuda")[: tokens // P].to(torch.int32)
    staging = torch.empty((L, C, nh, tokens, D), dtype=dtype, device="cuda")
    moved = staging.numel() * staging.element_size() * 2  # read + written
    res: dict = {"shape": {"layers": L, "kv": C, "page": P, "heads": H, "head_dim": D,
                           "tokens": tokens, "head_range": [h0, h0 + nh], "dtype": str(dtype),
                           "bytes_read_plus_written": moved}}  # fmt: skip

    def ms(fn):
        return do_bench(fn, warmup=50, rep=max(100, reps * 20), return_mode="median") / 1e3

    src = torch.empty_like(staging)
    dst = torch.empty_like(staging)
    res["d2d_copy_GBps"] = moved / ms(lambda: dst.copy_(src)) / 1e9
    contiguous_blocks = cache[:, :, : tokens // P]
    res["torch_strided_copy_GBps"] = moved / ms(
        lambda: staging.view(L, C, nh, tokens // P, P, D).copy_(
            contiguous_blocks[:, :, :, :, h0:h0 + nh].permute(0, 1, 4, 2, 3, 5))) / 1e9
    res["torch_gather_GBps"] = moved / ms(
        lambda: _kernels.gather(cache, table, tokens, staging, head_start=h0, backend="torch")) / 1e9
    res["torch_scatter_GBps"] = moved / ms(
        lambda: _kernels.scatter(staging, cache, table, tokens, head_start=h0,
                                 backend="torch")) / 1e9  # fmt: skip
    # correctness on this data, then the tile sweep
    ref = torch.empty_like(staging)
    _kernels.gather(cache, table, tokens, ref, head_start=h0, backend="torch")
    _kernels.gather(cache, table, tokens, staging, head_start=h0, backend="triton")
    res["gather_bit_exact"] = bool(torch.equal(ref.view(torch.int16), staging.view(torch.int16)))
    sweep = []
    for tile in (4096, 8192, 16384, 32768, 65536):
        for warps in (4, 8):
            _kernels.TILE_BYTES, _kernels.NUM_WARPS = tile, warps
            g = moved / ms(lambda: _kernels.gather(cache, table, tokens, staging,
                                                   head_start=h0, backend="triton")) / 1e9
            s = moved / ms(lambda: _kernels.scatter(staging, cache, table, tokens,
                                                    head_start=h0, backend="triton")) / 1e9
            sweep.append({"tile_bytes": tile, "num_warps": warps, "gather_GBps": g,
                          "scatter_GBps": s})  # fmt: skip
    res["triton_sweep"] = sweep
    best_g = max(sweep, key=lambda r: r["gather_GBps"])
    best_s = max(sweep, key=lambda r: r["scatter_GBps"])
    res["triton_gather_GBps"] = best_g["gather_GBps"]
    res["triton_scatter_GBps"] = best_s["scatter_GBps"]
    res["triton_gather_default_GBps"] = next(
        r["gather_GBps"] for r in sweep if (r["tile_bytes"], r["num_warps"]) == (16384, 4))
    res["best_gather_config"] = [best_g["tile_bytes"], best_g["num_warps"]]
    res["best_scatter_config"] = [best_s["tile_bytes"], best_s["num_warps"]]
    return res


def markdown(r: dict) -> str:
    p, b, k = r["pinned"], r["broker"], r["kernels"]
    lines = [
        f"# kvbroker GPU data path on {r['device']}",
        "",
        f"torch {r['torch']}, triton {r['triton']}, CUDA {r['cuda']}; medians.",
        "",
        "| path (1 GiB) | GB/s | × pinned |",
        "|---|---|---|",
        f"| pinned D2H | {p['pinned_d2h_GBps']:.1f} | 1.00 |",
        f"| pinned H2D | {p['pinned_h2d_GBps']:.1f} | 1.00 |",
        f"| pageable D2H | {p['pageable_d2h_GBps']:.1f} | {p['pageable_d2h_GBps'] / p['pinned_d2h_GBps']:.2f} |",
        f"| registered pool D2H (DMA only) | {b['registered_d2h_GBps']:.1f} | {b['registered_d2h_GBps'] / p['pinned_d2h_GBps']:.2f} |",
        f"| registered pool H2D (DMA only) | {b['registered_h2d_GBps']:.1f} | {b['registered_h2d_GBps'] / p['pinned_h2d_GBps']:.2f} |",
    ]  # fmt: skip
    for label in ("one_buffer", "128_buffers"):
        pub, cl = b[f"publish_d2h_{label}_GBps"], b[f"claim_h2d_{label}_GBps"]
        lines.append(f"| kvbroker publish D2H, {label} (whole call) | {pub:.1f} | "
                     f"{pub / p['pinned_d2h_GBps']:.2f} |")  # fmt: skip
        lines.append(f"| kvbroker claim H2D, {label} (whole call) | {cl:.1f} | "
                     f"{cl / p['pinned_h2d_GBps']:.2f} |")  # fmt: skip
    lines += [
        "",
        f"Pool map {b['map_s'] * 1e3:.0f} ms, cudaHostRegister {b['register_s'] * 1e3:.0f} ms "
        f"(once per process); round trip bit-exact: {b['bit_exact']}.",
        "",
        f"Kernels, shape {k['shape']} (bytes read + written):",
        "",
        "| copy | GB/s | × D2D |",
        "|---|---|---|",
    ]
    d2d = k["d2d_copy_GBps"]
    for name in ("d2d_copy_GBps", "triton_gather_GBps", "triton_scatter_GBps",
                 "triton_gather_default_GBps", "torch_strided_copy_GBps", "torch_gather_GBps",
                 "torch_scatter_GBps"):  # fmt: skip
        lines.append(f"| {name[:-5]} | {k[name]:.0f} | {k[name] / d2d:.2f} |")
    lines += ["", f"Best gather config (tile bytes, warps) {k['best_gather_config']}, "
              f"scatter {k['best_scatter_config']}; gather bit-exact: {k['gather_bit_exact']}."]
    if "pytest" in r:
        lines += ["", "CUDA tests: `" + r["pytest"]["summary"] + "`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pytest", action="store_true")
    a = ap.parse_args()
    import triton

    os.makedirs(a.out, exist_ok=True)
    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "cuda": torch.version.cuda}  # fmt: skip
    r["pinned"] = bench_pinned(GiB, a.reps)
    print("pinned", r["pinned"], flush=True)
    try:
        r["broker"] = bench_broker(GiB, a.reps)
    except Exception as exc:  # keep the other figures of this run
        r["broker_error"] = repr(exc)
    print("broker", r.get("broker"), r.get("broker_error", ""), flush=True)
    torch.cuda.empty_cache()
    r["kernels"] = bench_kernels(a.reps)
    print("kernels", {k: v for k, v in r["kernels"].items() if k != "triton_sweep"}, flush=True)
    if a.pytest:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/test_kernels.py", "tests/test_gpu.py"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        tail = p.stdout.strip().splitlines()
        r["pytest"] = {"rc": p.returncode, "summary": tail[-1] if tail else p.stderr[-300:]}
        with open(os.path.join(a.out, "pytest.txt"), "w") as f:
            f.write(p.stdout + p.stderr)
        print(p.stdout[-3000:], p.stderr[-2000:], flush=True)
    with open(os.path.join(a.out, "gpu.json"), "w") as f:
        json.dump(r, f, indent=2)
    md = markdown(r) if "broker" in r else json.dumps(r, indent=1)
    with open(os.path.join(a.out, "gpu.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
