"""Cost of the warm-restart journal on the put path, side by side in one run.

Two daemons on this host, one journaling (the default) and one with ``journal = false``
(``KVBROKER_JOURNAL=false``), same pool geometry. One client each; rounds alternate between
them so both see the same machine load. Each operation is ``put`` of a small object then a
consuming ``claim`` + ``release``: the journaled daemon appends a seal and an unlink record
per operation, its worst case (a prefix cache that keeps its blocks appends half that).

Usage: ``python benchmarks/bench_journal.py [--size 4096] [--ops 2000] [--rounds 7]
[--out benchmarks/results/journal-cpu.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from conftest import DaemonProcess  # noqa: E402


def one_round(client, size: int, ops: int, tag: str) -> float:
    """Seconds per put+claim+release, over ``ops`` operations."""
    payload = {"kv": np.full(size, 7, np.uint8)}
    t0 = time.perf_counter()
    for i in range(ops):
        key = f"{tag}-{i}"
        client.put(key, payload)
        with client.claim(key, consume=True) as lease:
            assert lease["kv"][0] == 7
    return (time.perf_counter() - t0) / ops


def _fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts), e.g. ext4 or tmpfs."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fs = line.split()[:3]
                if os.path.realpath(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fs
    except OSError:
        pass
    return kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "journal-cpu.json")
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="where the sockets and the journal live (default: a temp dir; "
        "/run, where the service keeps them, is a tmpfs: try /dev/shm)",
    )
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvbj", dir=args.dir)
    where = f"{tmp} ({_fs_type(tmp)})"
    geometry = ("--pool-size", "64M", "--page-size", "4K")
    daemons = {
        "journal": DaemonProcess(os.path.join(tmp, "on.sock"), *geometry),
        "no_journal": DaemonProcess(
            os.path.join(tmp, "off.sock"), *geometry, env={"KVBROKER_JOURNAL": "false"}
        ),
    }
    per_op: dict[str, list[float]] = {name: [] for name in daemons}
    try:
        clients = {name: d.client(name=f"bench-{name}") for name, d in daemons.items()}
        for c in clients.values():  # warm-up
            one_round(c, args.size, 200, "warm")
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                per_op[name].append(one_round(clients[name], args.size, args.ops, f"r{r}"))
        records = clients["journal"].stat()
        for c in clients.values():
            c.close()
    finally:
        for d in daemons.values():
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # sockets and journal (in /dev/shm: memory)
    med = {name: statistics.median(v) for name, v in per_op.items()}
    from kvbroker._bench._common import measured_commit

    result = {
        "benchmark": "journal overhead: put + consuming claim + release",
        "commit": measured_commit(),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "journal_dir": where,
        "object_bytes": args.size,
        "ops_per_round": args.ops,
        "rounds": args.rounds,
        "median_us": {name: round(v * 1e6, 2) for name, v in med.items()},
        "rounds_us": {name: [round(x * 1e6, 2) for x in v] for name, v in per_op.items()},
        "ratio_journal_over_none": round(med["journal"] / med["no_journal"], 3),
        "objects_left": records.objects,
    }
    print(f"put+claim+release of {args.size} B, median of {args.rounds} rounds x {args.ops} ops:")
    for name, v in med.items():
        print(f"  {name:>10}: {v * 1e6:8.1f} us")
    print(f"  journal / no journal = {result['ratio_journal_over_none']:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
