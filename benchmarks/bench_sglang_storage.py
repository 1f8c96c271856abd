"""kvbroker as SGLang's HiCache storage backend: ``batch_set_v1`` / ``batch_get_v1`` throughput.

For a Llama-3-8B-shaped KV of ``--tokens`` tokens (32 layers, 8 KV heads, head_dim 128, bf16)
in SGLang's own host pool (``MHATokenToKVPoolHost``, layout ``--layout``, pages of
``--page-size`` tokens), in one process and run, alternated over ``--rounds`` with fresh page
hashes each round, each variant moving every page the way SGLang's cache controller does
(batches of at most 128 pages, ``STORAGE_BATCH_SIZE``):

- **kvbroker set / get**: the backend SGLang's ``StorageBackendFactory.create_backend(
  "dynamic", ...)`` loads, zero-copy (``"interface_v1": 1``): ``batch_set_v1`` of every page
  with checksums (the default) and without; ``batch_get_v1`` of every page into other host
  slots (checked bit-exact once);
- **memcpy**: the same pages' bytes copied by ``numpy.copyto``, run by run, from the host pool
  into one contiguous buffer and back: the floor of any store;
- **HiCacheFile set / get**: SGLang's own file backend (``--hicache-storage-backend file``)
  under ``--file-dir`` (a disk directory, as its default ``/tmp/hicache``), through the path
  SGLang uses for it (``get_data_page`` + ``batch_set``; ``batch_get`` into dummy pages +
  ``set_from_flat_data_page``).

Ratios are taken within each round (the machine is shared: absolute times move with its
load), medians over the rounds. The results record the commit, the machine, the command line,
the load average and the CPU pressure (``/proc/pressure/cpu``) before and after.

    python benchmarks/bench_sglang_storage.py [--tokens 16384] [--rounds 5] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tests.sglang_helpers.torchvision_stub  # noqa: F401  (before SGLang)

# isort: split
import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvbroker._bench._common import (
    invocation,
    machine_info,
    measured_commit,
    median,
    ratio_span,
    spawned_daemon,
    write_results,
)
from tests.sglang_helpers.engine import host_pool

LAYERS, HEADS, DIM = 32, 8, 128
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
VARIANTS = (
    "kvbroker_set",
    "kvbroker_set_no_checksums",
    "kvbroker_get",
    "memcpy_out",
    "memcpy_in",
    "file_set",
    "file_get",
)


def psi() -> str | None:
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="meta-llama/Llama-3-8B",
        extra_config=extra,
    )


def batches(n: int):
    for lo in range(0, n, BATCH):
        yield lo, min(n, lo + BATCH)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--layout",
        default="page_first",
        choices=("layer_first", "page_first", "page_first_direct", "page_head"),
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--file-dir",
        default=None,
        help="HiCacheFile's directory (default: a new "
        "directory under the system's temporary directory)",
    )
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ps, n = a.page_size, a.tokens // a.page_size
    pressure_before, load_before = psi(), os.getloadavg()[0]
    # Pages [0, n) are what is stored; [n, 2n) what is loaded into.
    pool = host_pool(a.layout, layers=LAYERS, heads=HEADS, head_dim=DIM, page_size=ps, pages=2 * n)
    g = torch.Generator().manual_seed(1)
    for i in range(n):  # the pages stored: random bits (a page at a time: memory stays flat)
        page = pool.get_data_page(i * ps, flat=False).view(torch.int16)
        page.copy_(torch.randint(-30000, 30000, page.shape, dtype=torch.int16, generator=g))
    out_idx = torch.arange(0, n * ps, dtype=torch.int64)
    in_idx = torch.arange(n * ps, 2 * n * ps, dtype=torch.int64)
    page_bytes = pool.get_size_per_token() * ps
    total = n * page_bytes
    file_dir = tempfile.mkdtemp(prefix="hicache-bench-", dir=a.file_dir)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    exact = None
    try:
        with spawned_daemon(f"{total * 5 // 4 // (1 << 20) + 64}M") as sock:
            base = {
                "backend_name": "kvbroker",
                "module_path": "kvbroker.integrations.sglang",
                "class_name": "KVBrokerStorage",
                "interface_v1": 1,
                "socket": sock,
            }
            kv = StorageBackendFactory.create_backend("dynamic", config(base), pool)
            kv.register_mem_pool_host(pool)
            kv_plain = StorageBackendFactory.create_backend(
                "dynamic", config({**base, "checksum": False}), pool
            )
            kv_plain.register_mem_pool_host(pool)
            # Connect (and map the daemon's pools, pre-faulted) before timing: once per engine
            t = time.perf_counter()
            assert kv.batch_exists(["warm-up"]) == 0 and kv_plain.batch_exists(["warm-up"]) == 0
            connect_s = time.perf_counter() - t
            fb = StorageBackendFactory.create_backend(
                "file", config({"file_storage_path": file_dir}), pool
            )
            flat = np.empty(total, dtype=np.uint8)
            flat.fill(1)  # faulted in before the first round
            geometry = kv.store.geometry
            host = kv.store.host.array

            def memcpy(out: bool) -> None:
                for i in range(n):
                    at = geometry.start(i * ps)
                    for r in range(geometry.outer):
                        src = host[at + r * geometry.outer_stride :][: geometry.run]
                        dst = flat[(i * geometry.outer + r) * geometry.run :][: geometry.run]
                        np.copyto(dst, src) if out else np.copyto(src, dst)

            for rnd in range(a.rounds):
                keys = [hashlib.sha256(f"{rnd}/{i}".encode()).hexdigest() for i in range(n)]
                keys2 = [hashlib.sha256(f"{rnd}/plain/{i}".encode()).hexdigest() for i in range(n)]

                def kv_set(backend, ks) -> None:
                    for lo, hi in batches(n):
                        ok = backend.batch_set_v1(ks[lo:hi], out_idx[lo * ps : hi * ps])
                        assert all(ok), "kvbroker refused a batch (is the pool big enough?)"

                def kv_get(keys=keys) -> None:
                    for lo, hi in batches(n):
                        got = kv.batch_get_v1(keys[lo:hi], in_idx[lo * ps : hi * ps])
                        assert all(got), f"kvbroker lost pages: {sum(got)} of {len(got)}"

                def file_set(keys=keys) -> None:
                    for lo, hi in batches(n):
                        data = [pool.get_data_page(i * ps) for i in range(lo, hi)]
                        assert fb.batch_set(keys[lo:hi], data)

                def file_get(keys=keys) -> None:
                    for lo, hi in batches(n):
                        dummy = [pool.get_dummy_flat_data_page() for _ in range(lo, hi)]
                        pages = fb.batch_get(keys[lo:hi], dummy)
                        for i, page in zip(range(lo, hi), pages, strict=True):
                            pool.set_from_flat_data_page((n + i) * ps, page)

                steps = [
                    ("memcpy_out", lambda: memcpy(True)),
                    ("memcpy_in", lambda: memcpy(False)),
                    ("kvbroker_set", partial(kv_set, kv, keys)),
                    ("kvbroker_get", kv_get),
                    ("kvbroker_set_no_checksums", partial(kv_set, kv_plain, keys2)),
                    ("file_set", file_set),
                    ("file_get", file_get),
                ]
                if rnd % 2:
                    steps = steps[4:] + steps[:4]  # alternate who runs on a warm cache
                for name, fn in steps:
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
                    if name == "kvbroker_get" and exact is None:
                        exact = all(
                            torch.equal(
                                pool.get_data_page(i * ps).view(torch.int16),
                                pool.get_data_page((n + i) * ps).view(torch.int16),
                            )
                            for i in range(n)
                        )
                kv.clear()
                fb.clear()
            kv.close()
            kv_plain.close()
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)
    pressure_after, machine = psi(), machine_info()  # its load average: at the end

    def per_round(num: str, den: str) -> list[float]:
        return [x / y for x, y in zip(times[num], times[den], strict=True)]

    gbs = {v: total / median(ts) / 1e9 for v, ts in times.items()}
    ratios = {
        "kvbroker_set / memcpy_out": per_round("kvbroker_set", "memcpy_out"),
        "kvbroker_set_no_checksums / memcpy_out": per_round(
            "kvbroker_set_no_checksums", "memcpy_out"
        ),
        "kvbroker_get / memcpy_in": per_round("kvbroker_get", "memcpy_in"),
        "file_set / kvbroker_set": per_round("file_set", "kvbroker_set"),
        "file_get / kvbroker_get": per_round("file_get", "kvbroker_get"),
    }
    result = {
        "benchmark": "sglang_storage",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine,
        "psi_cpu_before": pressure_before,
        "psi_cpu_after": pressure_after,
        "loadavg_before": load_before,
        "tokens": a.tokens,
        "page_size": ps,
        "layout": a.layout,
        "pages": n,
        "bytes": total,
        "rounds": a.rounds,
        "bit_exact": exact,
        "connect_s": connect_s,
        "seconds": times,
        "median_GBps": gbs,
        "ratios": ratios,
        "file_dir": a.file_dir or tempfile.gettempdir(),
    }
    lines = [
        f"# SGLang HiCache storage: kvbroker beside memcpy and HiCacheFile ({machine['cpu']}, "
        f"{machine['cores']} cores)",
        "",
        f"Commit {result['commit']}; `{result['command']}`; {machine['when']}.",
        f"Llama-3-8B-shaped KV, {a.tokens} tokens = {n} pages of {ps} tokens "
        f"({page_bytes / (1 << 20):g} MiB each, {total / (1 << 30):.2f} GiB), host layout "
        f"`{a.layout}`, batches of {BATCH} pages, {a.rounds} rounds; HiCacheFile under "
        f"{result['file_dir']}.",
        f"Load average {load_before:.2f} before, {machine['loadavg_1min']:.2f} after; "
        f"CPU pressure before `{pressure_before}`, after `{pressure_after}`.",
        f"kvbroker's get bit-exact: {exact}. The two backends' first calls (connecting, mapping "
        f"the daemon's pools): {connect_s:.2f} s, before the rounds.",
        "",
        "| variant | median s | GB/s (of the median) | per round, s |",
        "|---|---|---|---|",
    ]
    for v in VARIANTS:
        lines.append(
            f"| {v} | {median(times[v]):.3f} | {gbs[v]:.2f} | "
            + ", ".join(f"{t:.3f}" for t in times[v])
            + " |"
        )
    lines += ["", "| ratio (per round) | median (least–most) |", "|---|---|"]
    lines += [f"| {k} | {ratio_span(v)} |" for k, v in ratios.items()]
    write_results(a.out, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
