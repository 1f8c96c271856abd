"""Integrity at the speed of the copies: the GPU checksum and the host copy engine, measured.

GPU part (a CUDA device, or ``--smoke`` on CPU with the torch fallback on a small buffer):
- the chunk kernel alone over ``--gpu-size`` (2 GiB) with the shipped launch settings
  (``gpu_checksum.NUM_WARPS``/``GROUP``), and ``checksums()`` end to end (table upload,
  kernel, digests back, combine) for one tensor and for 64 tensors of the same total;
- against a read-only pass over the same bytes (``int64`` sum: the "D2D read") and a
  device-to-device copy (which reads the same bytes and writes as many);
- overlap: a pinned device-to-host copy of the same bytes alone, and with the checksum
  running beside it on another stream (what a publish would do), and the reverse for a claim
  (host-to-device, then verify on the GPU);
- every value checked against the CPU definition once (``kvbroker._wire.checksum.digest``).
  ``--sweep`` adds a best-of over other launch settings, labelled as such.

GpuClient part (CUDA only), against a private daemon: an engine-shaped object, 32 layers x
K/V of ``(1, 8 heads, --tokens 16384, 128)`` bf16 (a 16k-token Llama-3-8B-shaped cache, 64
tensors of 32 MiB, 2 GiB), variants interleaved rep by rep:
- ``GpuClient.publish`` with integrity on (the default: kind-1 checksums on the GPU beside the
  DMA) and off, against a pinned device-to-host copy of the same 64 tensors (the same driver
  copies into a pinned buffer; target >= 0.9x);
- ``GpuClient.claim`` without and with ``verify=True`` against a pinned host-to-device copy
  (target >= 0.9x);
- the GPU verify of the claimed object: ``claim(verify=True)`` hashes each group of buffers
  (``gpu_client.VERIFY_GROUP_BYTES``) as soon as it landed, while the next groups copy; what
  it adds after the last copy (``GpuClient.last_verify_s``: the last group's kernel, the
  digests back, the combine) against a read-only pass over 2 GiB in device memory (target:
  the verify costs no more than 1/0.8 of that read, i.e. >= 0.8x); and, as extra rows, the
  same verify run alone on the claimed tensors, nothing overlapped and its set-up not hidden;
- the checksums recorded at seal checked once against the CPU definition, the claimed bytes
  against the published ones.

Host part, against a private daemon (``kvbroker.testing.running_daemon``), ``--host-size``
(32 MiB) buffers, variants interleaved rep by rep so that drift hits them alike:
- ``put`` (checksum on, the default) + ``get`` with the copy engine on 1 thread and on N
  (``--threads``, default: what the engine would pick here, at least 2 to compare), and
  ``get(verify=True)``;
- a multi-threaded memcpy of the same bytes with the same thread count (two copies: one for
  the put, one for the get), as the baseline.

Writes ``--out`` (default ``benchmarks/results/integrity-gpu-<device>``) ``.json`` and ``.md``
recording the commit, the machine and the command. Ratios are printed with two decimals.

Usage: ``python benchmarks/bench_integrity_gpu.py [--smoke] [--gpu-size 2G] [--host-size 32M]
[--tokens 16384] [--threads N] [--reps 30] [--sweep] [--no-gpu] [--no-client] [--no-host]
[--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from kvbroker._bench._common import measured_commit, ratio as _ratio  # noqa: E402
from kvbroker._client import engine as E  # noqa: E402
from kvbroker._wire import checksum as cs  # noqa: E402
from kvbroker._wire.paths import parse_size  # noqa: E402


def machine() -> dict:
    try:
        from kvbroker._bench._common import machine_info

        return machine_info()
    except ImportError:  # a checkout without the client's dependencies (GPU part only)
        return {
            "cpu": platform.processor(),
            "cores": os.cpu_count(),
            "loadavg_1min": os.getloadavg()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }


def median_time(fn, reps: int, sync=lambda: None) -> float:
    fn()
    sync()
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


# -- GPU ---------------------------------------------------------------------------------------
def gpu_part(args, rows: list, notes: list) -> dict:
    import torch

    from kvbroker._client import gpu_checksum as G

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        notes.append("no CUDA device: GPU part skipped (use --smoke for a CPU run)")
        return {}
    dev = torch.device("cuda" if cuda else "cpu")
    n = args.gpu_size if cuda else min(args.gpu_size, 8 << 20)
    backend = "triton" if cuda else "torch"
    x = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device=dev)
    x = x.view(torch.uint8)
    parts = list(x.view(64, -1))

    if cuda:
        from triton.testing import do_bench

        def gtime(fn, reps=None):  # median of CUDA-event timings, in seconds
            return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    else:

        def gtime(fn, reps=None):
            return median_time(fn, 3)

    # correctness first: every figure below is of a kernel that gives the CPU's values
    want = cs.digest(x.cpu().numpy())
    want_parts = [cs.digest(p.cpu().numpy()) for p in parts]
    got = G.checksums([x], backend=backend)[0]
    got_parts = G.checksums(parts, backend=backend)
    ok = got == want and got_parts == want_parts
    if not ok:
        notes.append("GPU CHECKSUM DIFFERS FROM THE CPU DEFINITION")

    out: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (torch fallback)",
        "bytes": n,
        "backend": backend,
        "num_warps": G.NUM_WARPS,
        "group": G.GROUP,
        "chunk": cs.CHUNK,
        "correct": ok,
        "torch": torch.__version__,
    }
    if cuda:
        import triton

        out["triton"] = triton.__version__
        _, kernel = G._triton()
        count = -(-n // cs.CHUNK)
        starts = np.arange(count, dtype=np.int64) * cs.CHUNK
        table = torch.from_numpy(
            np.stack([x.data_ptr() + starts, np.minimum(n - starts, cs.CHUNK)])
        ).to(dev)
        digests = torch.empty(count, dtype=torch.int64, device=dev)
        keys = G._keys(dev)

        def launch(nw=G.NUM_WARPS, group=G.GROUP):
            return lambda: kernel[(count,)](
                table[0], table[1], keys, digests, GROUP=group, num_warps=nw
            )

        t_kernel = gtime(launch())
    else:
        t_kernel = None
    t_one = gtime(lambda: G.checksums([x], backend=backend))
    t_many = gtime(lambda: G.checksums(parts, backend=backend))
    v64 = x.view(torch.int64)
    t_read = gtime(lambda: v64.sum())
    y = torch.empty_like(x)
    t_copy = gtime(lambda: y.copy_(x))
    out.update(
        kernel_s=t_kernel,
        checksums_1_s=t_one,
        checksums_64_s=t_many,
        read_s=t_read,
        d2d_copy_s=t_copy,
    )

    def row(what, t, base, base_name):
        rows.append(
            {
                "part": "gpu",
                "what": what,
                "ms": t * 1e3,
                "GB/s": n / t / 1e9,
                "vs": f"{_ratio(base / t)}x of {base_name}",
            }
        )

    if t_kernel is not None:
        row("checksum kernel (shipped settings)", t_kernel, t_read, "read")
    row("checksums(), 1 tensor, end to end", t_one, t_read, "read")
    row("checksums(), 64 tensors, end to end", t_many, t_read, "read")
    row("read-only pass (int64 sum)", t_read, t_read, "read")
    rows.append(
        {
            "part": "gpu",
            "what": "D2D copy (reads as many bytes)",
            "ms": t_copy * 1e3,
            "GB/s": n / t_copy / 1e9,
            "vs": f"{_ratio(t_read / t_copy)}x of read",
        }
    )
    if t_kernel is not None:
        rows[-1]["vs"] += f"; kernel is {_ratio(t_copy / t_kernel)}x faster"

    if cuda:
        # overlap: what a publish (D2H + hash) and a claim (H2D + verify) would cost
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()

        # interleaved rep by rep; the claim's two segments timed apart (a 2 GiB DMA varies by
        # about 1 ms from rep to rep, as much as the verify itself)
        sync = torch.cuda.synchronize
        seg: dict[str, list[float]] = {k: [] for k in ("d2h", "d2h+hash", "h2d", "verify")}
        for rep in range(args.reps + 2):
            sync()
            t0 = time.perf_counter()
            host.copy_(x, non_blocking=True)
            sync()
            t1 = time.perf_counter()
            side.wait_stream(main)
            pending = G.start(parts, stream=side)  # the publish: hash beside the DMA
            host.copy_(x, non_blocking=True)
            main.synchronize()
            pending.result()
            t2 = time.perf_counter()
            x.copy_(host, non_blocking=True)
            sync()
            t3 = time.perf_counter()
            G.checksums(parts)  # the claim's verify, once the bytes are on the GPU
            t4 = time.perf_counter()
            if rep >= 2:
                for k, v in (
                    ("d2h", t1 - t0),
                    ("d2h+hash", t2 - t1),
                    ("h2d", t3 - t2),
                    ("verify", t4 - t3),
                ):
                    seg[k].append(v)
        med = {k: statistics.median(v) for k, v in seg.items()}
        t_d2h, t_pub, t_h2d, t_ver = med["d2h"], med["d2h+hash"], med["h2d"], med["verify"]
        out.update(d2h_s=t_d2h, d2h_with_hash_s=t_pub, h2d_s=t_h2d, verify_after_h2d_s=t_ver)
        rows.append(
            {
                "part": "gpu",
                "what": "pinned D2H alone",
                "ms": t_d2h * 1e3,
                "GB/s": n / t_d2h / 1e9,
                "vs": "",
            }
        )
        rows.append(
            {
                "part": "gpu",
                "what": "pinned D2H + GPU checksum beside it (64 tensors)",
                "ms": t_pub * 1e3,
                "GB/s": n / t_pub / 1e9,
                "vs": f"{_ratio(t_d2h / t_pub)}x of D2H alone",
            }
        )
        rows.append(
            {
                "part": "gpu",
                "what": "pinned H2D alone",
                "ms": t_h2d * 1e3,
                "GB/s": n / t_h2d / 1e9,
                "vs": "",
            }
        )
        rows.append(
            {
                "part": "gpu",
                "what": "GPU verify after the H2D (64 tensors)",
                "ms": t_ver * 1e3,
                "GB/s": n / t_ver / 1e9,
                "vs": f"H2D + verify = {_ratio(t_h2d / (t_h2d + t_ver))}x of H2D alone",
            }
        )
        if args.sweep:
            best = []
            for group in (1, 2, 4, 8):
                for nw in (1, 2, 4):
                    best.append((gtime(launch(nw, group)), nw, group))
            best.sort()
            t, nw, group = best[0]
            out["sweep_best"] = {"s": t, "num_warps": nw, "group": group}
            rows.append(
                {
                    "part": "gpu",
                    "what": f"kernel, BEST-OF sweep (nw={nw}, group={group})",
                    "ms": t * 1e3,
                    "GB/s": n / t / 1e9,
                    "vs": f"{_ratio(t_read / t)}x of read",
                }
            )
    return out


# -- GpuClient: the engine-shaped publish and claim, integrity on -------------------------------
def client_part(args, rows: list, notes: list) -> dict:
    import torch

    if args.smoke or not torch.cuda.is_available():
        notes.append("GpuClient part skipped: it needs CUDA")
        return {}
    from kvbroker import gpu
    from kvbroker._client import gpu_integrity as GI
    from kvbroker._client.gpu_copy import copy_runs
    from kvbroker.testing import running_daemon

    layers, heads, dim, tokens = 32, 8, 128, args.tokens
    shape = (1, heads, tokens, dim)
    tensors = {}
    for i in range(layers):  # separate allocations, as a DynamicCache's layers are
        for part in ("key", "value"):
            tensors[f"past_{part}.{i}"] = torch.randint(
                -(2**15), 2**15, shape, dtype=torch.int16, device="cuda"
            ).view(torch.bfloat16)
    out = {n: torch.empty_like(t) for n, t in tensors.items()}
    each = tensors["past_key.0"].nbytes
    total = each * len(tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    base = host.data_ptr()
    d2h = [(base + i * each, t.data_ptr(), each) for i, t in enumerate(tensors.values())]
    h2d = [(t.data_ptr(), base + i * each, each) for i, t in enumerate(out.values())]
    stream = torch.cuda.Stream()
    sync = torch.cuda.synchronize
    names = (
        "d2h",
        "publish",
        "publish_nosum",
        "h2d",
        "claim",
        "claim_verify",
        "verify_tail",
        "verify_alone",
    )
    seg: dict[str, list[float]] = {k: [] for k in names}
    res: dict = {
        "shape": {
            "layers": layers,
            "kv": 2,
            "batch": 1,
            "heads": heads,
            "tokens": tokens,
            "head_dim": dim,
            "dtype": "bfloat16",
            "tensors": len(tensors),
            "bytes": total,
        }
    }
    pool = f"{(total >> 20) + 256}M"
    with running_daemon("--log-level", "warning", pool_size=pool, page_size="2M") as daemon:
        t0 = time.perf_counter()
        g = gpu.GpuClient(daemon.client(), own_client=True)
        res["register_s"] = time.perf_counter() - t0
        with g:
            res["checksum_kind"] = g.client.checksum_kind
            for rep in range(args.reps + 2):  # 2 warm-up reps
                t = {}
                sync()
                t0 = time.perf_counter()
                copy_runs(d2h, stream)
                stream.synchronize()
                t["d2h"] = time.perf_counter() - t0
                sync()
                t0 = time.perf_counter()
                assert g.publish(f"nosum{rep}", tensors, checksum=False)
                t["publish_nosum"] = time.perf_counter() - t0
                g.client.evict(f"nosum{rep}")
                sync()
                t0 = time.perf_counter()
                assert g.publish(f"k{rep}", tensors)  # integrity on: the default
                t["publish"] = time.perf_counter() - t0
                if rep == 0:  # the recorded checksums are the CPU definition's
                    want = {
                        n: cs.encode(cs.digest(x.view(-1).view(torch.uint8).cpu().numpy()))
                        for n, x in tensors.items()
                    }
                    res["checksums_match_cpu"] = g.client.lookup(f"k{rep}").checksums == want
                    if not res["checksums_match_cpu"]:
                        notes.append("GPU PUBLISH CHECKSUMS DIFFER FROM THE CPU DEFINITION")
                sync()
                t0 = time.perf_counter()
                copy_runs(h2d, stream)
                stream.synchronize()
                t["h2d"] = time.perf_counter() - t0
                sync()
                t0 = time.perf_counter()
                g.claim(f"k{rep}", out)
                sync()
                t["claim"] = time.perf_counter() - t0
                for x in out.values():  # the verify must see the claim's bytes, not these
                    x.zero_()
                sync()
                t0 = time.perf_counter()
                g.claim(f"k{rep}", out, verify=True, consume=True)
                sync()
                t["claim_verify"] = time.perf_counter() - t0
                t["verify_tail"] = g.last_verify_s
                # the same verify alone on the claimed tensors: set-up, kernels, digests back
                sync()
                t0 = time.perf_counter()
                computed = GI.start_verify(out, want, lambda d: None).device_values()
                t["verify_alone"] = time.perf_counter() - t0
                if GI.mismatched(computed, want):
                    notes.append("GPU VERIFY FLAGGED A CLEAN OBJECT")
                if rep >= 2:
                    for k, v in t.items():
                        seg[k].append(v)
            res["bit_exact"] = all(
                torch.equal(out[n].view(torch.int16), tensors[n].view(torch.int16)) for n in tensors
            )
            if not res["bit_exact"]:
                notes.append("CLAIMED BYTES DIFFER FROM THE PUBLISHED ONES")
    from triton.testing import do_bench

    flat = torch.empty(total, dtype=torch.uint8, device="cuda").view(torch.int64)
    flat.random_()
    t_read = do_bench(flat.sum, warmup=25, rep=200, return_mode="median") / 1e3
    t_read64 = (
        do_bench(
            lambda: [x.view(torch.int64).sum() for x in out.values()],
            warmup=25,
            rep=200,
            return_mode="median",
        )
        / 1e3
    )
    del flat
    med = {k: statistics.median(v) for k, v in seg.items()}
    res.update(
        {f"{k}_s": v for k, v in med.items()},
        read_s=t_read,
        read_64_tensors_s=t_read64,
        reps=args.reps,
    )

    def row(what, key, vs):
        tt = med[key] if isinstance(key, str) else key
        rows.append(
            {"part": "client", "what": what, "ms": tt * 1e3, "GB/s": total / tt / 1e9, "vs": vs}
        )

    row("pinned D2H, 64 tensors (the baseline)", "d2h", "")
    row(
        "GpuClient.publish, integrity on (GPU checksum beside the DMA)",
        "publish",
        f"{_ratio(med['d2h'] / med['publish'])}x of pinned D2H (target >= 0.90)",
    )
    row(
        "GpuClient.publish, checksum=False",
        "publish_nosum",
        f"{_ratio(med['d2h'] / med['publish_nosum'])}x of pinned D2H",
    )
    row("pinned H2D, 64 tensors (the baseline)", "h2d", "")
    row(
        "GpuClient.claim",
        "claim",
        f"{_ratio(med['h2d'] / med['claim'])}x of pinned H2D (target >= 0.90)",
    )
    row(
        "GpuClient.claim(verify=True)",
        "claim_verify",
        f"{_ratio(med['h2d'] / med['claim_verify'])}x of pinned H2D",
    )
    row("read-only pass over 2 GiB in device memory (int64 sum)", t_read, "")
    row(
        "read-only pass over the 64 claimed tensors",
        t_read64,
        f"{_ratio(t_read / t_read64)}x of the 2 GiB read",
    )
    row(
        "GPU verify inside claim(verify=True): what it adds after the last copy "
        "(last_verify_s; the groups before were hashed during the copies)",
        "verify_tail",
        f"{_ratio(t_read / med['verify_tail'])}x of a D2D read of 2 GiB (target >= 0.80)",
    )
    row(
        "GPU verify run alone on the claimed tensors (set-up not hidden)",
        "verify_alone",
        f"{_ratio(t_read / med['verify_alone'])}x of a D2D read",
    )
    return res


# -- host --------------------------------------------------------------------------------------
def host_part(args, rows: list, notes: list) -> dict:
    from kvbroker.testing import running_daemon

    size = args.host_size
    threads = args.threads or max(2, E.default_threads())
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.empty_like(src)
    scratch = np.empty_like(src)
    engines = {1: E.CopyEngine(1), threads: E.CopyEngine(threads)}
    saved = E._default
    times: dict[str, list[float]] = {}
    try:
        with (
            running_daemon(
                "--log-level", "warning", pool_size=str(max(16 * size, 256 << 20)), page_size=None
            ) as daemon,
            daemon.client() as c,
        ):
            variants = {}
            for t, eng in engines.items():
                variants[f"put+get, {t} thread(s)"] = (eng, False)
                variants[f"put+get(verify), {t} thread(s)"] = (eng, True)
            for rep in range(args.reps + 3):  # 3 warm-up reps
                for name, (eng, verify) in variants.items():
                    E._default = eng
                    key = f"k{rep}"
                    t0 = time.perf_counter()
                    c.put(key, {"a": src})
                    c.get(key, {"a": out}, verify=verify)
                    dt = time.perf_counter() - t0
                    c.evict(key)
                    if rep >= 3:
                        times.setdefault(name, []).append(dt)
                for t, eng in engines.items():  # the baseline: two plain copies per rep
                    t0 = time.perf_counter()
                    eng.copy(scratch, src)
                    eng.copy(out, scratch)
                    if rep >= 3:
                        times.setdefault(f"2x memcpy, {t} thread(s)", []).append(
                            time.perf_counter() - t0
                        )
                    t0 = time.perf_counter()
                    eng.copy_hashed(scratch, src)
                    if rep >= 3:
                        times.setdefault(f"copy_hashed alone, {t} thread(s)", []).append(
                            time.perf_counter() - t0
                        )
                    t0 = time.perf_counter()
                    eng.copy(scratch, src)
                    if rep >= 3:
                        times.setdefault(f"memcpy alone, {t} thread(s)", []).append(
                            time.perf_counter() - t0
                        )
            if not np.array_equal(out, src):
                notes.append("HOST COPY DIFFERS")
    finally:
        E._default = saved
        for eng in engines.values():
            eng.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for t in engines:
        base = med[f"2x memcpy, {t} thread(s)"]
        for name in (
            f"put+get, {t} thread(s)",
            f"put+get(verify), {t} thread(s)",
            f"2x memcpy, {t} thread(s)",
        ):
            rows.append(
                {
                    "part": "host",
                    "what": name,
                    "ms": med[name] * 1e3,
                    "GB/s": 2 * size / med[name] / 1e9,
                    "vs": f"{_ratio(base / med[name])}x of 2x memcpy ({t} thread(s))",
                }
            )
        cp, ch = med[f"memcpy alone, {t} thread(s)"], med[f"copy_hashed alone, {t} thread(s)"]
        rows.append(
            {
                "part": "host",
                "what": f"copy_hashed alone, {t} thread(s)",
                "ms": ch * 1e3,
                "GB/s": size / ch / 1e9,
                "vs": f"{_ratio(cp / ch)}x of memcpy ({cp * 1e3:.2f} ms)",
            }
        )
    t1, tn = med["put+get, 1 thread(s)"], med[f"put+get, {threads} thread(s)"]
    rows.append(
        {
            "part": "host",
            "what": f"put+get: {threads} threads vs 1",
            "ms": tn * 1e3,
            "GB/s": 2 * size / tn / 1e9,
            "vs": f"{_ratio(t1 / tn)}x faster than 1 thread",
        }
    )
    return {
        "bytes": size,
        "threads": threads,
        "default_threads": E.default_threads(),
        "median_s": med,
        "reps": args.reps,
    }


def table(rows: list) -> str:
    lines = ["| part | what | ms | GB/s | ratio |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['part']} | {r['what']} | {r['ms']:.3f} | {r['GB/s']:.1f} | {r['vs']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small sizes; GPU part on the CPU")
    ap.add_argument("--gpu-size", default="2G")
    ap.add_argument("--host-size", default="32M")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the engine-shaped object")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also a best-of over launch settings")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--no-client", action="store_true", help="skip the GpuClient part")
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--out", default=None, help="path prefix for .json and .md")
    ap.add_argument("--commit", default=None, help="record this commit (a copy without .git)")
    args = ap.parse_args()
    args.gpu_size = parse_size(args.gpu_size)
    args.host_size = parse_size(args.host_size)
    if args.smoke:
        args.reps = min(args.reps, 5)
        args.host_size = min(args.host_size, 8 << 20)
    rows: list = []
    notes: list = []
    report = {
        "commit": args.commit or measured_commit(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine(),
        "platform": platform.platform(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
    }
    if not args.no_gpu:
        try:
            report["gpu"] = gpu_part(args, rows, notes)
        except ImportError as exc:
            notes.append(f"GPU part skipped: {exc}")
    if not args.no_gpu and not args.no_client:
        try:
            report["client"] = client_part(args, rows, notes)
        except ImportError as exc:
            notes.append(f"GpuClient part skipped: {exc}")
        except Exception as exc:  # the other parts still run and are written
            import traceback

            traceback.print_exc()
            notes.append(f"GPUCLIENT PART FAILED: {type(exc).__name__}: {exc}".upper())
    if not args.no_host:
        report["host"] = host_part(args, rows, notes)
    report["rows"] = rows
    report["notes"] = notes
    dev = report.get("gpu", {}).get("device", "cpu")
    tag = "smoke" if args.smoke else "".join(ch if ch.isalnum() else "-" for ch in dev.lower())
    prefix = args.out or os.path.join(ROOT, "benchmarks", "results", f"integrity-gpu-{tag}")
    md = [
        f"# bench_integrity_gpu: {dev}",
        "",
        f"- commit: `{report['commit']}`",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine']['cpu']}, {report['affinity_cpus']} CPUs usable, "
        f"load {report['machine']['loadavg_1min']}, {report['machine']['when']}",
        f"- GPU settings: {json.dumps({k: report.get('gpu', {}).get(k) for k in ('num_warps', 'group', 'chunk', 'correct')})}",  # noqa: E501
        "",
        table(rows),
        "",
    ] + [f"- NOTE: {n}" for n in notes]
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {prefix}.json and {prefix}.md")
    if notes and any(n.isupper() or "DIFFERS" in n for n in notes):
        sys.exit(1)


if __name__ == "__main__":
    main()
