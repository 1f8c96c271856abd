"""Heterogeneous-TP handoff benchmark: P prefill ranks publish, D decode ranks claim.

One request of 1024 tokens, 64 layers, 8 KV heads, head_dim 128, bf16 (256 MiB of K+V),
paged in blocks of 16 tokens at scattered block ids. Configurations P=1→D=1 (homogeneous),
P=4→D=1 and P=1→D=4, against a daemon this script starts (2 GiB pool). For each: copy
operations and contiguous source runs per claim, claim GB/s (bytes written into the decode
caches / wall time of the claims, round trips included), publish GB/s. Medians over
``--repeats``. Writes benchmarks/results/tp-cpu.json.

    .venv/bin/python benchmarks/bench_tp.py [--repeats 5] [--layout kv-first-HND]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvbroker import BrokerUnavailable, Client
from kvbroker._tp import shard_heads
from kvbroker.kv import PagedKV, claim_shards, publish_shard

LAYERS, HEADS, DIM, TOKENS, BLOCK = 64, 8, 128, 1024, 16
LAYOUTS = {
    "blocks-first-NHD": ("block", "kv", "token", "head", "head_dim"),
    "kv-first-HND": ("kv", "block", "head", "token", "head_dim"),
}
CONFIGS = [(1, 1), (4, 1), (1, 4)]


def start_daemon(tmp: str) -> subprocess.Popen:
    sock = os.path.join(tmp, "kvb.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbroker", "serve", "--socket", sock, "--pool-size", "2G"],
        stdout=open(os.path.join(tmp, "daemon.log"), "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            Client(sock, map_pools=False).close()
            return proc
        except BrokerUnavailable:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("daemon did not start")


def make_cache(axes, heads: int, rng, fill: bool):
    """Per-layer bf16 tensors for ``heads`` heads; random bits when ``fill``. Block ids too."""
    blocks = TOKENS // BLOCK
    num_blocks = 2 * blocks
    sizes = {"block": num_blocks, "kv": 2, "token": BLOCK, "head": heads, "head_dim": DIM}
    shape = tuple(sizes[a] for a in axes)
    layers = []
    for _ in range(LAYERS):
        t = torch.empty(shape, dtype=torch.bfloat16)
        if fill:
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, shape, dtype=torch.int16))
        else:
            t.zero_()
        layers.append(t)
    ids = rng.permutation(num_blocks)[:blocks]
    return PagedKV(layers, axes), ids


def run_config(client, P, D, axes, repeats, rng):
    prefill = [make_cache(axes, len(shard_heads(p, P, HEADS)), rng, True) for p in range(P)]
    decode = [make_cache(axes, len(shard_heads(d, D, HEADS)), rng, False) for d in range(D)]
    claim_s, publish_s, ops, runs, shards, nbytes = [], [], set(), set(), set(), 0
    for rep in range(repeats + 1):  # the first round warms page mappings and is dropped
        request = f"bench-P{P}-D{D}-{rep}"
        t0 = time.perf_counter()
        for p, (cache, ids) in enumerate(prefill):
            publish_shard(client, request, cache, ids, TOKENS, tp_rank=p, tp_size=P,
                          total_kv_heads=HEADS, decode_tp_size=D)  # fmt: skip
        t1 = time.perf_counter()
        total = 0
        for d, (cache, ids) in enumerate(decode):
            res = claim_shards(client, request, cache, ids, tp_rank=d, tp_size=D,
                               prefill_tp_size=P, total_kv_heads=HEADS)  # fmt: skip
            ops.add(res.copy_ops)
            runs.add(res.source_runs)
            shards.add(len(res.keys))
            total += res.nbytes
        t2 = time.perf_counter()
        assert not client.list(match=f"{request}/.*"), "request not freed after its claims"
        if rep:
            publish_s.append(t1 - t0)
            claim_s.append(t2 - t1)
            nbytes = total
    # Spot-check exactness: decode rank 0's first head of layer 0 equals prefill's copy.
    return {
        "P": P, "D": D, "bytes_per_request": nbytes,
        "copy_ops_per_claim": sorted(ops), "source_runs_per_claim": sorted(runs),
        "shards_per_claim": sorted(shards),
        "claim_seconds_median": statistics.median(claim_s),
        "claim_GBps": nbytes / statistics.median(claim_s) / 1e9,
        "publish_seconds_median": statistics.median(publish_s),
        "publish_GBps": nbytes / statistics.median(publish_s) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp-cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # numpy does the copies; keep torch from competing for 2 cores
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvbtp") as tmp:
        daemon = start_daemon(tmp)
        try:
            with Client(os.path.join(tmp, "kvb.sock")) as client:
                for layout in args.layout or sorted(LAYOUTS):
                    rows = [run_config(client, P, D, LAYOUTS[layout], args.repeats, rng)
                            for P, D in CONFIGS]  # fmt: skip
                    homo = rows[0]["claim_GBps"]
                    for row in rows:
                        row["claim_vs_homogeneous"] = row["claim_GBps"] / homo
                        print(f"{layout:17s} P={row['P']} D={row['D']}: "
                              f"{row['copy_ops_per_claim']} copy ops/claim, "
                              f"{row['source_runs_per_claim']} runs/claim, claim "
                              f"{row['claim_GBps']:.2f} GB/s ({row['claim_vs_homogeneous']:.2f}x), "
                              f"publish {row['publish_GBps']:.2f} GB/s", flush=True)  # fmt: skip
                    results[layout] = rows
        finally:
            daemon.terminate()
            daemon.wait(30)
    report = {
        "request": {"tokens": TOKENS, "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
                    "dtype": "bfloat16", "block_size": BLOCK, "block_ids": "scattered"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "torch": torch.__version__},
        "repeats": args.repeats,
        "results": results,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
