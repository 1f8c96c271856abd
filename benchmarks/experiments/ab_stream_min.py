"""A/B of the copy engine's streaming-store threshold (``kvbroker._client.engine.STREAM_MIN``)
in whole put+get round trips: ``kvbroker bench transfer``'s loop (with the peer benchmark's
multi-threaded memcpy beside it) against one private daemon, alternating per round between
each ``--stream-min`` value (``never``: ordinary stores only) in the same process.

Usage: ``python benchmarks/experiments/ab_stream_min.py [--sizes 16M,32M] [--stream-min 16M,never]
[--rounds 3] [--reps 60] [--out PREFIX]`` (writes PREFIX.json and PREFIX.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

from kvbroker._bench import transfer  # noqa: E402
from kvbroker._bench._common import machine_info, measured_commit, spawned_daemon  # noqa: E402
from kvbroker._client import engine as E  # noqa: E402
from kvbroker._wire.paths import parse_size  # noqa: E402

NEVER = 1 << 62


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16M,32M")
    ap.add_argument("--stream-min", default="16M,never")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--pool-size", default="2G")
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "stream-stores", "ab")
    )
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    arms = [(v, NEVER if v == "never" else parse_size(v)) for v in a.stream_min.split(",")]
    rows = []
    with spawned_daemon(a.pool_size) as sock:
        for rnd in range(1, a.rounds + 1):
            for label, stream_min in arms:
                E.default_engine().stream_min = stream_min
                for r in transfer.measure(sock, sizes, reps=a.reps, split_baseline=True):
                    rows.append({"round": rnd, "stream_min": label, **r})
                    print(
                        f"round {rnd} stream_min {label:6s} {r['size'] >> 20} MiB: "
                        f"x memcpy {r['ratio_vs_memcpy']:.2f}, x memcpy same threads "
                        f"{r['ratio_vs_split_memcpy']:.2f} ({r['copy_threads']} threads), "
                        f"put {r['put_p50_us']:.0f} get {r['get_p50_us']:.0f} us",
                        flush=True,
                    )
    result = {
        "commit": measured_commit(),
        "machine": machine_info(),
        "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    m = result["machine"]
    lines = [
        f"# Streaming-store threshold, put+get A/B ({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}, {m.get('when')}; `{result['command']}`",
        "",
        "Per size and threshold: the median over rounds of each round's ratio (range in "
        "brackets), put and get p50.",
        "",
        "| size | stream_min | × memcpy | × memcpy, same threads | put µs | get µs |",
        "|---|---|---|---|---|---|",
    ]
    for size in sizes:
        for label, _ in arms:
            rs = [r for r in rows if r["size"] == size and r["stream_min"] == label]

            def med(key, rs=rs):
                xs = [r[key] for r in rs]
                return statistics.median(xs), min(xs), max(xs)

            x, s = med("ratio_vs_memcpy"), med("ratio_vs_split_memcpy")
            lines.append(
                f"| {size >> 20} MiB | {label} | {x[0]:.2f} ({x[1]:.2f}–{x[2]:.2f}) | "
                f"{s[0]:.2f} ({s[1]:.2f}–{s[2]:.2f}) | {med('put_p50_us')[0]:.0f} | "
                f"{med('get_p50_us')[0]:.0f} |"
            )
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
