"""``kvbroker bench transfer``: publish + claim of one buffer per object against memcpy.

``put`` copies the source once into the pool; ``get`` copies the pool once into the
destination. "publish+claim GB/s" counts both copies (2 × size bytes over the put+get time)
and is compared with memcpy of the same size, measured in the same loop: memcpy and put+get
alternate, so a noisy neighbour hits both alike.

With ``split_baseline`` (``bench peer``) the loop also times a multi-threaded memcpy: the same
bytes copied twice (source to a scratch buffer, scratch to the destination: a put and a get),
each copy cut into the ranges the host copy engine would use for that size at that moment
(:meth:`kvbroker._client.engine.CopyEngine.ranges`), one thread per range. That is the limit
for put+get on a machine where the engine runs several threads.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ._common import KiB, MiB, Result, Target, median, pct, save_figure

# Powers of 4 from 4 KiB to 256 MiB, and 32 MiB (the size of the targets).
DEFAULT_SIZES = tuple(sorted({4 * KiB * 4**i for i in range(9)} | {32 * MiB}))
COLUMNS = [
    ("size", "size", "size"),
    ("memcpy_gbps", "memcpy GB/s", ".2f"),
    ("publish_gbps", "publish GB/s", ".2f"),
    ("claim_gbps", "claim GB/s", ".2f"),
    ("publish_claim_gbps", "pub+claim GB/s", ".2f"),
    ("ratio_vs_memcpy", "x memcpy", "ratio"),
    ("roundtrip_p50_us", "p50 us", ".1f"),
    ("roundtrip_p99_us", "p99 us", ".1f"),
]


class SplitMemcpy:
    """``numpy.copyto`` of slices, one thread per slice, the calling thread taking the first: a
    plain multi-threaded memcpy (copyto releases the GIL), cut as ``engine`` (a
    :class:`~kvbroker._client.engine.CopyEngine`) cuts the same size at that moment, without
    its chunking or hashing."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(engine.threads - 1) if engine.threads > 1 else None

    def copy(self, dst, src) -> int:
        """``dst[:] = src``; returns the number of threads that copied."""
        import numpy as np

        first, *rest = self.engine.ranges(src.nbytes)
        futures = [self._pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in rest]
        try:
            np.copyto(dst[first[0] : first[1]], src[first[0] : first[1]])
        finally:
            for f in futures:
                f.result()
        return 1 + len(rest)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def measure(
    socket_path: str,
    sizes=DEFAULT_SIZES,
    budget_bytes: int = 2 << 30,
    min_reps: int = 20,
    reps: int | None = None,
    split_baseline: bool = False,
) -> list[dict]:
    """One row per size; the bytes claimed are checked against the bytes published.

    ``reps`` fixes the timed round trips per size; by default about ``budget_bytes`` are
    moved per size (at least ``min_reps``, at most 2000 round trips). ``split_baseline``:
    also time two multi-threaded memcpys per round trip (see the module doc) and add
    ``copy_threads``, ``split_memcpy2_p50_us`` and ``ratio_vs_split_memcpy`` to each row."""
    fixed_reps = reps
    import numpy as np

    from .. import Client
    from .._client.engine import default_engine

    rows = []
    with Client(socket_path, name="bench-transfer", role="bench") as c:
        for size in sizes:
            reps = fixed_reps or int(max(min_reps, min(2000, budget_bytes // (4 * size))))
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            dst = np.empty_like(src)
            dst.fill(0)  # fault the destination in before timing
            np.copyto(dst, src)
            split = SplitMemcpy(default_engine()) if split_baseline else None
            if split is not None:
                scratch = np.empty_like(src)
                scratch.fill(0)
            memcpy, split2, split_threads, put_t, get_t, rt = [], [], [], [], [], []
            try:
                for i in range(reps + 3):
                    key = f"bench-{size}-{i}"
                    tm = time.perf_counter()
                    np.copyto(dst, src)
                    t0 = time.perf_counter()
                    one_memcpy = t0 - tm
                    if split is not None:
                        threads = split.copy(scratch, src)  # as a put would
                        split.copy(dst, scratch)  # as a get would
                        ts, t0 = t0, time.perf_counter()
                        if i >= 3:
                            split2.append(t0 - ts)
                            split_threads.append(threads)
                    c.put(key, {"kv": src})
                    t1 = time.perf_counter()
                    c.get(key, {"kv": dst}, consume=True)
                    t2 = time.perf_counter()
                    if i >= 3:  # warm-up
                        memcpy.append(one_memcpy)
                        put_t.append(t1 - t0)
                        get_t.append(t2 - t1)
                        rt.append(t2 - t0)
            finally:
                if split is not None:
                    split.close()
            if not np.array_equal(dst, src):
                raise AssertionError(f"bytes differ at size {size}")
            m, p, g, r = (median(x) for x in (memcpy, put_t, get_t, rt))
            rows.append(
                {
                    "size": size,
                    "reps": reps,
                    "memcpy_gbps": size / m / 1e9,
                    "publish_gbps": size / p / 1e9,
                    "claim_gbps": size / g / 1e9,
                    "publish_claim_gbps": 2 * size / r / 1e9,
                    # put+get moves the bytes twice; memcpy once: 2 memcpys is the physical limit.
                    "ratio_vs_memcpy": (2 * m) / r,
                    "memcpy_p50_us": m * 1e6,
                    "roundtrip_p50_us": r * 1e6,
                    "roundtrip_p99_us": pct(rt, 0.99) * 1e6,
                    "put_p50_us": p * 1e6,
                    "put_p99_us": pct(put_t, 0.99) * 1e6,
                    "get_p50_us": g * 1e6,
                    "get_p99_us": pct(get_t, 0.99) * 1e6,
                }
            )
            if split is not None:
                s2 = median(split2)
                rows[-1].update(
                    {
                        # what most round trips used (an engine gated on spare CPU may vary)
                        "copy_threads": statistics.median_low(split_threads),
                        "split_memcpy2_p50_us": s2 * 1e6,
                        # both sides copy the bytes twice, over the same number of threads
                        "ratio_vs_split_memcpy": s2 / r,
                    }
                )
    return rows


def targets(rows: list[dict]) -> list[Target]:
    out = []
    for row in rows:
        if row["size"] == 32 * MiB:
            out.append(Target("32 MiB publish+claim vs memcpy", row["ratio_vs_memcpy"], 0.9))
    return out


def run(socket_path: str, sizes=DEFAULT_SIZES, budget_bytes: int = 2 << 30) -> Result:
    rows = measure(socket_path, sizes, budget_bytes)
    return Result(
        "transfer",
        rows,
        COLUMNS,
        params={"sizes": list(sizes), "budget_bytes": budget_bytes},
        targets=targets(rows),
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    sizes = [r["size"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (
        ("memcpy_gbps", "memcpy (same loop)"),
        ("publish_claim_gbps", "publish+claim (2 copies)"),
        ("publish_gbps", "publish"),
        ("claim_gbps", "claim"),
    ):
        a.plot(sizes, [r[key] for r in rows], marker="o", label=label)
    a.set_xscale("log", base=2)
    a.set_xlabel("object size (bytes)")
    a.set_ylabel("GB/s")
    a.set_title("transfer throughput")
    a.legend(fontsize=8)
    b.plot(sizes, [r["roundtrip_p50_us"] for r in rows], marker="o", label="put+get p50")
    b.plot(sizes, [r["roundtrip_p99_us"] for r in rows], marker="x", label="put+get p99")
    b.plot(sizes, [r["memcpy_p50_us"] * 2 for r in rows], ls="--", label="2 x memcpy p50")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("object size (bytes)")
    b.set_ylabel("µs")
    b.set_title("put+get latency")
    b.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "transfer.png")]
