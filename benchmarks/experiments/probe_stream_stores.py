"""Probe: the C loops' copies with ordinary stores against non-temporal (streaming) stores,
beside the multi-threaded memcpy the peer benchmark compares with.

For each size and thread count, in turn per step: numpy's ``copyto`` split over the threads
(the baseline), then the C ``copy`` and ``copy_hashed`` with ordinary and with streaming stores
(``copy_hashed`` in 256 KiB pieces over several threads, whole chunks on one, as the engine
does), each into ``/dev/shm`` (a put) and out of it into private memory (a get). After every
copy the same small piece of Python work is timed (dict lookups over ~1 MiB of objects, as a
request handler does): what the copy left of the caches for the next request. Medians of
``--reps`` steps per round, per-round ratios to the baseline on the same threads.

Usage: ``python benchmarks/experiments/probe_stream_stores.py [--threads 8] [--sizes 4M,32M]
[--rounds 3] [--reps 15] [--out PREFIX]``
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kvbroker._bench._common import machine_info, measured_commit  # noqa: E402
from kvbroker._client import engine as E  # noqa: E402
from kvbroker._wire import checksum as cs  # noqa: E402
from kvbroker._wire.paths import parse_size  # noqa: E402
from profile_host_copy import shm_regions  # noqa: E402

REGIONS = 6


def variants(threads: int):
    """name -> (engine, fn(engine, dst, src)) for one thread count."""
    from kvbroker import _copyhash

    piece = E.PIECE if threads > 1 else 0
    split = E.CopyEngine(threads, split_min=cs.CHUNK, native=False)  # np.copyto per range

    def c_copy(stream):
        def fn(e, dst, src):
            e._run(
                lambda d, s, a, b: _copyhash.copy(d[a:b], s[a:b], stream),
                (dst, src),
                e.ranges(src.nbytes),
            )

        return fn

    def c_hashed(stream):
        def fn(e, dst, src):
            parts = e._run(
                lambda d, s, a, b: _copyhash.copy_hashed(d[a:b], s[a:b], cs.CHUNK, piece, stream),
                (dst, src),
                e.ranges(src.nbytes),
            )
            return cs.combine(src.nbytes, [d for part in parts for d in part])

        return fn

    native = E.CopyEngine(threads, split_min=cs.CHUNK, native=True)
    return {
        "memcpy (numpy copyto per thread)": (split, lambda e, d, s: e.copy(d, s)),
        "copy, ordinary stores": (native, c_copy(False)),
        "copy, streaming stores": (native, c_copy(True)),
        "copy+hash, ordinary stores": (native, c_hashed(False)),
        "copy+hash, streaming stores": (native, c_hashed(True)),
    }


def python_work(table: dict, keys: list) -> float:
    """Dict lookups over ~1 MiB of objects: a stand-in for the next request's handler."""
    t = time.perf_counter()
    n = 0
    for k in keys:
        n += table[k][0]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--sizes", default="4M,32M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "stream-stores", "probe")
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    table = {f"key-{i:06d}": [i, str(i)] for i in range(8000)}
    keys = list(table)
    rng.shuffle(keys)
    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        src = rng.integers(0, 256, size, dtype=np.uint8)
        want = cs.digest(src)
        regions = shm_regions(size, REGIONS)
        private = [np.zeros(size, np.uint8) for _ in range(REGIONS)]
        for threads in sorted({1, args.threads}):
            vs = variants(threads)
            for name, (e, fn) in vs.items():  # every variant copies right, hashes right
                for r in regions[:1]:
                    got = fn(e, r, src)
                    if not np.array_equal(r, src) or (got is not None and got != want):
                        raise AssertionError(f"{name}: bytes or checksum differ")
            per_round = {}
            turn = 0
            for _rnd in range(args.rounds):
                times = {(n, d): [] for n in vs for d in ("put", "get")}
                after = {(n, d): [] for n in vs for d in ("put", "get")}
                for _ in range(args.reps):
                    for name, (e, fn) in vs.items():
                        for direction in ("put", "get"):
                            shm = regions[turn % REGIONS]
                            mine = private[turn % REGIONS]
                            turn += 1
                            dst, s = (shm, src) if direction == "put" else (mine, regions[0])
                            t = time.perf_counter()
                            fn(e, dst, s)
                            times[name, direction].append(time.perf_counter() - t)
                            after[name, direction].append(python_work(table, keys))
                for (name, direction), xs in times.items():
                    base = statistics.median(times["memcpy (numpy copyto per thread)", direction])
                    m = statistics.median(xs)
                    per_round.setdefault((name, direction), []).append(
                        (m, base / m, statistics.median(after[name, direction]))
                    )
            for (name, direction), vals in per_round.items():
                rows.append(
                    {
                        "size": size,
                        "threads": threads,
                        "variant": name,
                        "direction": direction,
                        "p50_us_per_round": [v[0] * 1e6 for v in vals],
                        "vs_memcpy_per_round": [v[1] for v in vals],
                        "python_after_us_per_round": [v[2] * 1e6 for v in vals],
                    }
                )
                r = rows[-1]
                print(
                    f"{size >> 20} MiB {threads} thr {direction} {name:34s} "
                    f"x memcpy {statistics.median(r['vs_memcpy_per_round']):.2f} "
                    f"({min(r['vs_memcpy_per_round']):.2f}-{max(r['vs_memcpy_per_round']):.2f})"
                    f"  python after {statistics.median(r['python_after_us_per_round']):.0f} us",
                    flush=True,
                )
            for e in {id(e): e for e, _ in vs.values()}.values():  # the engines this count used
                e.close()
    result = {
        "commit": measured_commit(),
        "machine": machine_info(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    m = result["machine"]
    lines = [
        f"# Ordinary against streaming stores ({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}, {m.get('when')}; `{result['command']}`",
        "",
        "Per variant: the median over rounds of the per-round ratio to the memcpy on the "
        "same threads (range in brackets), and the median time of the Python work done "
        "right after the copy.",
        "",
        "| size | threads | direction | variant | × memcpy | Python after, µs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["vs_memcpy_per_round"]
        lines.append(
            f"| {r['size'] >> 20} MiB | {r['threads']} | {r['direction']} | "
            f"{r['variant']} | {statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f}) "
            f"| {statistics.median(r['python_after_us_per_round']):.0f} |"
        )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
