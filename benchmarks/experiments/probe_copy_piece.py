"""Probe: the C loops' copy+hash of a chunk in one piece (memcpy 1 MiB, then xxh3 of it) against
pieces of 64-256 KiB (memcpy a piece, feed it to a streaming xxh3, next piece), so the hash
reads from L1/L2 rather than from a 1 MiB chunk that may have left them. 32 MiB into
``/dev/shm`` over 1 and ``--threads`` threads, beside a memcpy over as many threads, each
variant in turn per step; medians of ``--reps`` steps per round, per-round ratios to the
memcpy on the same threads.

Usage: ``python benchmarks/experiments/probe_copy_piece.py [--threads 8] [--rounds 5] [--reps 20]
[--out PREFIX]``
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
from profile_host_copy import shm_regions  # noqa: E402


def engine_with_piece(threads: int, piece: int) -> E.CopyEngine:
    from kvbroker import _copyhash

    class Engine(E.CopyEngine):  # every range in pieces of `piece` bytes (0: whole chunks)
        def copy_hashed(self, dst, src) -> int:
            parts = self._run(
                lambda d, s, a, b: _copyhash.copy_hashed(d[a:b], s[a:b], cs.CHUNK, piece),
                (dst, src),
                self.ranges(src.nbytes),
            )
            return cs.combine(src.nbytes, [d for part in parts for d in part])

    return Engine(threads, split_min=cs.CHUNK, native=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "copy-piece"))
    args = ap.parse_args()
    size = 32 << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    want = cs.digest(src)
    regions = shm_regions(size, 8)
    engines = {}
    for n in (1, args.threads):
        engines[f"memcpy, {n} thread(s)"] = (E.CopyEngine(n, split_min=cs.CHUNK), "copy")
        for piece in (0, 64 << 10, 128 << 10, 256 << 10):
            label = "1 MiB chunk in one piece" if not piece else f"pieces of {piece >> 10} KiB"
            engines[f"copy_hashed, {n} thread(s), {label}"] = (
                engine_with_piece(n, piece),
                "hashed",
            )
    turn = 0
    for name, (e, kind) in engines.items():
        if kind == "hashed" and e.copy_hashed(regions[0], src) != want:
            raise AssertionError(f"{name}: checksum differs")
    medians = {k: [] for k in engines}
    ratios = {k: [] for k in engines}
    for _ in range(args.rounds):
        times = {k: [] for k in engines}
        for _ in range(args.reps):
            for name, (e, kind) in engines.items():
                dst = regions[turn % 8]
                turn += 1
                t = time.perf_counter()
                e.copy(dst, src) if kind == "copy" else e.copy_hashed(dst, src)
                times[name].append(time.perf_counter() - t)
        for name, xs in times.items():
            medians[name].append(statistics.median(xs))
        for name in engines:
            n = name.split(", ")[1].split(" ")[0]
            base = medians[f"memcpy, {n} thread(s)"][-1]
            ratios[name].append(base / medians[name][-1])
    for e, _ in engines.values():
        e.close()
    rows = [
        {
            "what": k,
            "ms": statistics.median(medians[k]) * 1e3,
            "x_memcpy_same_threads": statistics.median(ratios[k]),
            "range": [min(ratios[k]), max(ratios[k])],
        }
        for k in engines
    ]
    m = machine_info()
    report = {
        "commit": measured_commit(),
        "command": shlex.join(sys.argv),
        "machine": m,
        "rounds": args.rounds,
        "reps": args.reps,
        "rows": rows,
    }
    md = [
        f"# probe_copy_piece: {m['cpu']}, {os.cpu_count()} CPUs",
        "",
        f"- commit: `{report['commit']}`",
        f"- command: `{report['command']}`",
        f"- 32 MiB into /dev/shm, {args.rounds} rounds of {args.reps} steps; {m['when']}",
        "",
        "| variant | ms (median) | x memcpy same threads (rounds) |",
        "|---|---:|---|",
    ]
    for r in rows:
        cut = [
            f"{int(v * 100 + 1e-9) / 100:.2f}" for v in (r["x_memcpy_same_threads"], *r["range"])
        ]
        md.append(f"| {r['what']} | {r['ms']:.3f} | {cut[0]} ({cut[1]}-{cut[2]}) |")
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
