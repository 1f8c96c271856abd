"""Put+get hot path: a put through the write arena against reserve + seal, interleaved.

Two clients of one private daemon: ``reserve_seal`` puts with reserve + copy + seal
(``arena_size=0``, the path every put took before arenas), ``arena`` with the default write
arena (copy + ``publish``, one round trip; objects up to half the arena). Both get with claim
+ copy + release. Each iteration times a numpy memcpy and both put+gets back to back (order
alternating), so a noisy neighbour on this shared machine hits all three alike; ratios
compare medians of the same run.

    .venv/bin/python benchmarks/experiments/bench_hotpath.py [--sizes 256K,4M,32M] [--checksum on|off|both]
        [--json benchmarks/results/hotpath-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import machine_info  # noqa: E402
from kvbroker._bench import _common  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(path: str, size: int, reps: int, checksum: bool) -> dict:
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)
    times: dict[str, list[float]] = {"memcpy": [], "reserve_seal": [], "arena": []}
    with Client(path, name="reserve-seal", arena_size=0) as plain, Client(path, name="arena") as ar:
        variants = (("reserve_seal", plain), ("arena", ar))
        for i in range(reps + 5):
            t = time.perf_counter()
            np.copyto(dst, src)
            m = time.perf_counter() - t
            for name, c in variants if i % 2 else variants[::-1]:
                key = f"hp-{name}-{size}-{i}"
                t = time.perf_counter()
                c.put(key, {"kv": src}, checksum=checksum)
                c.get(key, {"kv": dst}, consume=True)
                dt = time.perf_counter() - t
                if i >= 5:
                    times[name].append(dt)
                if not (i % 97 or np.array_equal(dst, src)):
                    raise AssertionError(f"bytes differ ({name}, {size})")
            if i >= 5:
                times["memcpy"].append(m)
    m = statistics.median(times["memcpy"])
    row = {"size": size, "reps": reps, "checksum": checksum, "memcpy_gbps": size / m / 1e9}
    for name in ("reserve_seal", "arena"):
        r = statistics.median(times[name])
        row[f"{name}_p50_us"] = r * 1e6
        row[f"{name}_p99_us"] = _pct(times[name], 0.99) * 1e6
        row[f"{name}_gbps"] = 2 * size / r / 1e9
        row[f"{name}_x_memcpy"] = 2 * m / r
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256K,4M,32M")
    ap.add_argument("--checksum", choices=("on", "off", "both"), default="both")
    ap.add_argument("--budget", type=int, default=1 << 30, help="bytes per size and variant")
    ap.add_argument("--json")
    a = ap.parse_args()
    sums = {"on": [True], "off": [False], "both": [True, False]}[a.checksum]
    rows = []
    with _common.spawned_daemon("1G") as path:
        for checksum in sums:
            for size in map(_size, a.sizes.split(",")):
                reps = int(max(30, min(2000, a.budget // (2 * size))))
                rows.append(measure(path, size, reps, checksum))
    head = (
        f"{'size':>8} {'cksum':>5} {'memcpy GB/s':>11} | {'reserve+seal p50/p99 us':>23} "
        f"{'x memcpy':>8} | {'arena p50/p99 us':>19} {'x memcpy':>8}"
    )
    print(head)
    for r in rows:
        print(
            f"{_common.human_size(r['size']):>8} "
            f"{'on' if r['checksum'] else 'off':>5} {r['memcpy_gbps']:11.2f} | "
            f"    {r['reserve_seal_p50_us']:9.1f}/{r['reserve_seal_p99_us']:9.1f} "
            f"{r['reserve_seal_x_memcpy']:8.2f} | "
            f"{r['arena_p50_us']:9.1f}/{r['arena_p99_us']:9.1f} {r['arena_x_memcpy']:8.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "scenario": "hotpath",
                    "machine": machine_info(),
                    "rows": rows,
                    "load_avg": os.getloadavg(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
