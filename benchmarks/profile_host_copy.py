"""Where a checksummed host copy spends its time, against memcpy, on this machine (no daemon).

The bytes go from an ordinary numpy array into a ``/dev/shm`` mapping (as a put copies into
a pool: ``MAP_SHARED | MAP_POPULATE``, 4 KiB pages where shmem has no huge pages), rotating
over 8 regions so that each copy writes memory that is not in cache. Every variant runs
once per step in turn, ``--reps`` steps per round, and each round's medians are divided by
that round's ``memcpy -> shm``: a noisy neighbour hits all alike. Reported: the median of the
round ratios and their range, and the 1-minute load average over the rounds.

- ``memcpy -> shm``, ``memcpy -> anon``: one ``numpy.copyto`` of the whole size;
- ``1 MiB chunks, no hash``: the engine's loop without the hash (the cost of chunking);
- ``copy_hashed, N thread(s)``: the host copy engine (:mod:`kvbroker._client.engine`) at
  1 thread and at ``--threads`` (default 2), splitting whenever the size allows, through its
  C loops and, beside them, its Python loops (where the C extension is built); where the C
  loops copy and hash in one pass (AVX2), their two-pass form too (``two passes``: each
  chunk copied, then hashed by xxHash);
- ``memcpy, N threads``: the engine's plain copy over the same threads;
- ``stream K``: a chunk copied ``K`` bytes at a time, each piece fed to a streaming xxh3_64
  (the same digest as the chunk's one-shot hash), so the hash reads from a smaller cache;
- ``copy 2/4 MiB, hash 1 MiB``: fewer, larger copies, each then hashed chunk by chunk.

Then, on one thread: xxh3_64 of 1 MiB in cache and of 32 MiB just written (cold), the Python
between chunks (the engine's loop with empty copies and hashes), and two threads hashing or
copying a cached 1 MiB at once against one (both calls release the GIL if two run as fast
as one). Every checksum is checked against :func:`kvbroker._wire.checksum.digest`.

Usage: ``python benchmarks/profile_host_copy.py [--size 32M] [--rounds 8] [--reps 10]
[--threads 2] [--out PREFIX]`` (writes ``PREFIX.json`` and ``.md``; default
``benchmarks/results/host-copy-cpu``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shlex
import statistics
import sys
import threading
import time

import numpy as np
import xxhash

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

from kvbroker._bench._common import machine_info, measured_commit  # noqa: E402
from kvbroker._client import engine as _engine  # noqa: E402
from kvbroker._client.engine import CopyEngine  # noqa: E402
from kvbroker._wire import checksum as cs  # noqa: E402
from kvbroker._wire.paths import parse_size  # noqa: E402

CHUNK = cs.CHUNK
_hash = xxhash.xxh3_64_intdigest


def shm_regions(size: int, count: int) -> list:
    """``count`` views of ``size`` bytes of one populated ``/dev/shm`` mapping (unlinked)."""
    path = f"/dev/shm/kvb-profile-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size * count)
        mm = mmap.mmap(fd, size * count, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    flat = np.frombuffer(mm, dtype=np.uint8)
    return [flat[i * size : (i + 1) * size] for i in range(count)]


def streamed(piece: int):
    def run(dst, src) -> int:
        digests = []
        for at in range(0, src.nbytes, CHUNK):
            state = xxhash.xxh3_64()
            for p in range(at, min(at + CHUNK, src.nbytes), piece):
                part = dst[p : min(p + piece, at + CHUNK, src.nbytes)]
                np.copyto(part, src[p : p + part.nbytes])
                state.update(part)
            digests.append(state.intdigest())
        return cs.combine(src.nbytes, digests)

    return run


def coarse(copy_bytes: int):
    def run(dst, src) -> int:
        digests = []
        for at in range(0, src.nbytes, copy_bytes):
            end = min(at + copy_bytes, src.nbytes)
            np.copyto(dst[at:end], src[at:end])
            digests += [_hash(dst[c : min(c + CHUNK, end)]) for c in range(at, end, CHUNK)]
        return cs.combine(src.nbytes, digests)

    return run


def two_passes(copy_hashed):
    """``copy_hashed`` with the C loops' one-pass copy+hash off for the call."""
    from kvbroker import _copyhash

    def run(dst, src) -> int:
        _copyhash.use_fused(False)
        try:
            return copy_hashed(dst, src)
        finally:
            _copyhash.use_fused(True)

    return run


def chunked_copy(dst, src) -> None:
    for at in range(0, src.nbytes, CHUNK):
        np.copyto(dst[at : at + CHUNK], src[at : at + CHUNK])


def copy_variants(args) -> tuple[list[dict], dict]:
    size, n = args.size, args.threads
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    want = cs.digest(src)
    regions = shm_regions(size, 8)
    anon = [np.ones(size, dtype=np.uint8) for _ in range(2)]  # written: its pages exist
    one = CopyEngine(1, split_min=CHUNK)
    many = CopyEngine(n, split_min=CHUNK)
    engines = [one, many]
    fused = one.native and _engine.fused_loop()
    loops = ("C loops, one pass" if fused else "C loops") if one.native else "Python loops"
    variants = {
        "memcpy -> shm": lambda d, s: np.copyto(d, s),
        "memcpy -> anon": None,  # set below: its own destination (see target)
        "1 MiB chunks, no hash": chunked_copy,
        f"copy_hashed, 1 thread, {loops}": one.copy_hashed,
        f"copy_hashed, {n} threads, {loops}": many.copy_hashed,
    }
    if fused:  # the two-pass C loops (copy, then xxHash's hash) beside the one-pass loop
        variants["copy_hashed, 1 thread, C loops, two passes"] = two_passes(one.copy_hashed)
        variants[f"copy_hashed, {n} threads, C loops, two passes"] = two_passes(many.copy_hashed)
    if one.native:  # the Python loops beside them, in the same run
        engines += [
            CopyEngine(1, split_min=CHUNK, native=False),
            CopyEngine(n, split_min=CHUNK, native=False),
        ]
        variants["copy_hashed, 1 thread, Python loops"] = engines[2].copy_hashed
        variants[f"copy_hashed, {n} threads, Python loops"] = engines[3].copy_hashed
    variants |= {
        f"memcpy, {n} threads": many.copy,
        "stream 256 KiB": streamed(256 << 10),
        "stream 512 KiB": streamed(512 << 10),
        "copy 2 MiB, hash 1 MiB": coarse(2 << 20),
        "copy 4 MiB, hash 1 MiB": coarse(4 << 20),
    }
    hashed = [k for k in variants if k.startswith("stream") or ("hash" in k and "no hash" not in k)]
    turn = [0]

    def target(name: str):
        turn[0] += 1
        return anon[turn[0] % 2] if name == "memcpy -> anon" else regions[turn[0] % len(regions)]

    variants["memcpy -> anon"] = lambda d, s: np.copyto(d, s)
    for name, fn in variants.items():  # one untimed pass; every checksum is the definition's
        if fn(target(name), src) != want and name in hashed:
            raise AssertionError(f"{name}: checksum differs from kvbroker._wire.checksum.digest")
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    medians: dict[str, list[float]] = {k: [] for k in variants}
    loads = []
    try:
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(args.reps):
                for name, fn in variants.items():
                    dst = target(name)
                    t = time.perf_counter()
                    fn(dst, src)
                    times[name].append(time.perf_counter() - t)
            base = statistics.median(times["memcpy -> shm"])
            for name, xs in times.items():
                medians[name].append(statistics.median(xs))
                ratios[name].append(base / statistics.median(xs))
    finally:
        for engine in engines:
            engine.close()
    rows = [
        {
            "what": name,
            "ms": statistics.median(medians[name]) * 1e3,
            "x_memcpy_shm": statistics.median(ratios[name]),
            "range": [min(ratios[name]), max(ratios[name])],
        }
        for name in variants
    ]
    # the measure: a checksummed copy against a memcpy over as many threads, per round
    split = [
        m / h
        for m, h in zip(
            medians[f"memcpy, {n} threads"],
            medians[f"copy_hashed, {n} threads, {loops}"],
            strict=True,
        )
    ]
    return rows, {
        "load_1min": [min(loads), max(loads)],
        "loops": loops,
        "x_split_memcpy": [statistics.median(split), min(split), max(split)],
    }


def _parallel(fn, threads: int, calls: int) -> float:
    """Microseconds per call when ``threads`` threads each make ``calls`` calls at once."""
    workers = [threading.Thread(target=fn, args=(i, calls)) for i in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (time.perf_counter() - t) / calls * 1e6


def unit_costs(args) -> list[dict]:
    size = args.size
    bufs = [np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8) for i in range(2)]
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(2)]
    big_src = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    big = shm_regions(size, 1)[0]

    def hashes(i, k):
        for _ in range(k):
            _hash(bufs[i])

    def copies(i, k):
        for _ in range(k):
            np.copyto(outs[i], bufs[i])

    def loop_only():  # the engine's per-chunk Python with nothing to copy or hash
        empty_dst, empty_src, out = big[:0], big_src[:0], []
        for at in range(0, size, CHUNK):
            piece = big[at : at + CHUNK]
            big_src[at : at + piece.nbytes]
            np.copyto(empty_dst, empty_src)
            out.append(_hash(empty_dst))

    def cold_hash():
        np.copyto(big, big_src)
        chunked_copy(np.empty_like(big_src), big_src)  # push big out of cache
        t = time.perf_counter()
        for at in range(0, size, CHUNK):
            _hash(big[at : at + CHUNK])
        return time.perf_counter() - t

    calls = max(200, args.reps * 100)
    rows = []
    for name, fn in (("xxh3_64 of 1 MiB in cache", hashes), ("copyto of 1 MiB in cache", copies)):
        alone = statistics.median(_parallel(fn, 1, calls) for _ in range(3))
        both = statistics.median(_parallel(fn, 2, calls) for _ in range(3))
        rows.append({"what": f"{name}, 1 thread", "us": alone})
        rows.append({"what": f"{name}, 2 threads at once (each)", "us": both})
    rows.append(
        {
            "what": f"xxh3_64 of {size >> 20} MiB just written, cold, per MiB",
            "us": statistics.median(cold_hash() for _ in range(args.reps)) * 1e6 / (size / CHUNK),
        }
    )
    loop = []
    for _ in range(args.reps * 10):
        t = time.perf_counter()
        loop_only()
        loop.append(time.perf_counter() - t)
    rows.append(
        {
            "what": f"Python between chunks, all {size // CHUNK} chunks",
            "us": statistics.median(loop) * 1e6,
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="32M")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "host-copy-cpu"))
    args = ap.parse_args()
    args.size = parse_size(args.size)
    if args.size < 2 * CHUNK or args.rounds < 1 or args.reps < 1 or args.threads < 2:
        ap.error("--size of 2 MiB or more, --rounds and --reps of 1 or more, --threads >= 2")
    rows, extra = copy_variants(args)
    units = unit_costs(args)
    m = machine_info()
    report = {
        "commit": measured_commit(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": m,
        "size": args.size,
        "rounds": args.rounds,
        "reps": args.reps,
        "copies": rows,
        "units": units,
        **extra,
    }
    lo, hi = extra["load_1min"]
    md = [
        f"# profile_host_copy: {m['cpu']}, {os.cpu_count()} CPUs",
        "",
        f"- commit: `{report['commit']}`",
        f"- command: `{report['command']}`",
        f"- {args.size >> 20} MiB, {args.rounds} rounds of {args.reps} steps; load (1 min) "
        f"{lo:.2f}-{hi:.2f}; {m['when']}",
        "",
        "| copy into /dev/shm | ms (median) | x memcpy -> shm (rounds) |",
        "|---|---:|---|",
    ]
    for r in rows:  # ratios cut to two decimals, never rounded up
        cut = [f"{int(v * 100 + 1e-9) / 100:.2f}" for v in (r["x_memcpy_shm"], *r["range"])]
        md.append(f"| {r['what']} | {r['ms']:.3f} | {cut[0]} ({cut[1]}-{cut[2]}) |")
    cut = [f"{int(v * 100 + 1e-9) / 100:.2f}" for v in extra["x_split_memcpy"]]
    md += [
        "",
        f"copy_hashed on {args.threads} threads ({extra['loops']}) against a memcpy on "
        f"as many threads, per round: **{cut[0]}x** ({cut[1]}-{cut[2]})",
    ]
    md += ["", "| one thread unless said | us |", "|---|---:|"]
    md += [f"| {u['what']} | {u['us']:.1f} |" for u in units]
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
