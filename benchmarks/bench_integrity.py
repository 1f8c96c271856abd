"""What checksums cost: put/get of one buffer with and without them, side by side in one run.

Starts a daemon on a private socket and, alternating the variants rep by rep so that drift
hits them alike, times:
- ``put`` with ``checksum=True`` (chunked copy + xxh3 of each chunk while hot) against
  ``checksum=False`` (one plain copy);
- ``reserve`` + fill + ``seal`` with the hash at seal (a second read of the bytes) against
  the same without checksum;
- ``get`` with ``verify=True`` (chunked copy-out + hash) against plain ``get``.
Medians of wall time per call; the ratio is with / without (1.00 = free).

Usage: ``python benchmarks/bench_integrity.py [--size 32M] [--reps 40] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvbroker.testing import running_daemon  # noqa: E402
from kvbroker._wire.paths import format_size, parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="32M")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    size = parse_size(args.size)
    with running_daemon(
        "--log-level", "warning", pool_size=str(max(8 * size, 256 << 20)), page_size=None
    ) as daemon:
        c = daemon.client()
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        out = np.empty_like(src)
        variants = {
            "put+checksum": lambda k: c.put(k, {"a": src}, checksum=True),
            "put": lambda k: c.put(k, {"a": src}, checksum=False),
        }

        def reserve_fill(checksum):
            def run(k):
                with c.reserve(k, {"a": size}, checksum=checksum) as lease:
                    np.copyto(lease["a"], src)

            return run

        variants["reserve+seal hash"] = reserve_fill(True)
        variants["reserve+seal"] = reserve_fill(False)
        times: dict[str, list[float]] = {v: [] for v in variants}
        times["get+verify"], times["get"] = [], []
        for rep in range(args.reps + 3):  # 3 warm-up reps
            for name, fn in variants.items():
                key = f"{name}-{rep}"
                t = time.perf_counter()
                fn(key)
                dt = time.perf_counter() - t
                if rep >= 3:
                    times[name].append(dt)
                if name == "put+checksum":
                    for gname, verify in (("get+verify", True), ("get", False)):
                        t = time.perf_counter()
                        c.get(key, {"a": out}, verify=verify)
                        if rep >= 3:
                            times[gname].append(time.perf_counter() - t)
                c.evict(key)
        med = {k: statistics.median(v) for k, v in times.items()}
        pairs = [
            ("put+checksum", "put"),
            ("reserve+seal hash", "reserve+seal"),
            ("get+verify", "get"),
        ]
        from kvbroker._bench._common import invocation, measured_commit

        report = {
            "commit": measured_commit(),
            "command": invocation(),
            "size": size,
            "reps": args.reps,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "median_s": med,
            "gb_per_s": {k: size / v / 1e9 for k, v in med.items()},
            "ratio_with_over_without": {a: med[a] / med[b] for a, b in pairs},
        }
        print(f"{format_size(size)} x {args.reps} reps, medians (one run, alternating)")
        for a, b in pairs:
            print(
                f"  {a:<18} {med[a] * 1e3:8.2f} ms {size / med[a] / 1e9:6.2f} GB/s   "
                f"{b:<14} {med[b] * 1e3:8.2f} ms {size / med[b] / 1e9:6.2f} GB/s   "
                f"ratio {med[a] / med[b]:.3f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        c.close()


if __name__ == "__main__":
    main()
