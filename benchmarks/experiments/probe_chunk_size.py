"""The sweep behind CHUNK = 1 MiB (kvbroker/_wire/checksum.py): the GPU chunk kernel over 2 GiB
at chunk sizes 256 KiB / 1 MiB / 4 MiB and a few launch settings, ``checksums()`` end to end,
and the host copy engine (32 MiB copy / copy_hashed / hash) at chunk sizes 256 KiB to 4 MiB
over 1, 4, 8, 16 threads. Needs CUDA and Triton; prints a table (no results file: the figures
it gave on an H100 host are quoted in benchmarks/results/integrity-gpu-h100-chunk-sweep.txt).

Usage: ``python benchmarks/experiments/probe_chunk_size.py``.
"""

import os
import statistics
import sys
import time

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kvbroker._client import engine as E  # noqa: E402
from kvbroker._client import gpu_checksum as g  # noqa: E402
from kvbroker._wire import checksum as C  # noqa: E402

dev = torch.device("cuda")
N = 2 << 30
big = torch.randint(-(2**31), 2**31 - 1, (N // 4,), dtype=torch.int32, device=dev).view(torch.uint8)
ref = C.digest(big.cpu().numpy())
_, kern = g._triton()
keys = g._keys(dev)
for ch in (256 << 10, 1 << 20, 4 << 20):
    a = torch.arange(N // ch, dtype=torch.int64, device=dev) * ch + big.data_ptr()
    ln = torch.full_like(a, ch)
    out = torch.empty_like(a)
    for G, nw in ((4, 1), (8, 1), (4, 2), (2, 1)):
        ms = do_bench(
            lambda: kern[(a.numel(),)](a, ln, keys, out, GROUP=G, num_warps=nw),
            warmup=30,
            rep=150,
            return_mode="median",
        )
        print(f"chunk {ch >> 10}K G={G} nw={nw}: {ms:.3f} ms {N / ms / 1e6:.0f} GB/s")
for label, ts in (("1x2GiB", [big]), ("64x32MiB", list(big.view(64, -1)))):
    ms = do_bench(lambda: g.checksums(ts), warmup=20, rep=200, return_mode="median")
    print(
        f"checksums() {label}: {ms:.3f} ms {N / ms / 1e6:.0f} GB/s ok={g.checksums([big])[0] == ref}"
    )
print(
    f"int64 sum {do_bench(lambda: big.view(torch.int64).sum(), rep=200, return_mode='median'):.3f} ms"
)


def tm(f, reps=15):
    f()
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


n = 32 << 20
s = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
d = np.ones(n, np.uint8)
for ch in (256 << 10, 1 << 20, 2 << 20, 4 << 20):
    C.CHUNK = ch  # the engine and the definition read it at call time
    r = C.digest(s)
    for th in (1, 4, 8, 16):
        e = E.CopyEngine(th, split_min=ch)
        assert e.copy_hashed(d, s) == r
        c, chh, hh = (
            tm(lambda: e.copy(d, s)),
            tm(lambda: e.copy_hashed(d, s)),
            tm(lambda: e.hash(s)),
        )
        print(
            f"chunk {ch >> 10}K t={th}: memcpy {n / c / 1e9:.1f} copy_hashed {n / chh / 1e9:.1f} "
            f"({c / chh:.2f}x) hash {n / hh / 1e9:.1f} GB/s"
        )
        e.close()
