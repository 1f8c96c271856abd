"""Heterogeneous-TP handoff benchmark: P prefill ranks publish, D decode ranks claim.

One request of 1024 tokens, 64 layers, 8 KV heads, head_dim 128, bf16 (256 MiB of K+V),
paged in blocks of 16 tokens at scattered block ids. Configurations P=1→D=1 (homogeneous),
P=4→D=1 and P=1→D=4, against a daemon this script starts (1 GiB pool). For each: copy
operations and contiguous source runs per claim, claim GB/s (bytes written into the decode
caches / wall time of the claims, round trips included), publish GB/s. The configurations
are interleaved within each repeat (the machine is shared: load falls on all alike); medians
over ``--repeats``; the last repeat is checked bit for bit.

Part of the installed package, so ``kvbroker bench tp`` runs anywhere torch is installed;
``benchmarks/bench_tp.py`` in a checkout runs :func:`main` and writes
``benchmarks/results/tp-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kvbroker._client.tp import shard_heads
from kvbroker.kv import PagedKV, claim_shards, publish_shard

LAYERS, HEADS, DIM, TOKENS, BLOCK = 64, 8, 128, 1024, 16
LAYOUTS = {
    "blocks-first-NHD": ("block", "kv", "token", "head", "head_dim"),
    "kv-first-HND": ("kv", "block", "head", "token", "head_dim"),
}
CONFIGS = [(1, 1), (4, 1), (1, 4)]


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


def run_layout(client, axes, repeats, rng):
    """Every configuration, interleaved: repeat r runs P=D=1, then P=4→D=1, then P=1→D=4, so
    load from other processes on this shared machine falls on all of them alike. Caches of the
    same (TP size, side) are shared between configurations."""
    caches = {}

    def ranks(side, tp):
        if (side, tp) not in caches:
            fill = side == "prefill"
            caches[side, tp] = [
                make_cache(axes, len(shard_heads(r, tp, HEADS)), rng, fill) for r in range(tp)
            ]
        return caches[side, tp]

    rows = {
        cfg: {
            "P": cfg[0],
            "D": cfg[1],
            "claim_s": [],
            "publish_s": [],
            "ops": set(),
            "runs": set(),
            "shards": set(),
            "nbytes": 0,
        }
        for cfg in CONFIGS
    }
    for rep in range(repeats + 1):  # the first round warms page mappings and is dropped
        for P, D in CONFIGS:
            row = rows[P, D]
            request = f"bench-P{P}-D{D}-{rep}"
            t0 = time.perf_counter()
            for p, (cache, ids) in enumerate(ranks("prefill", P)):
                publish_shard(
                    client,
                    request,
                    cache,
                    ids,
                    TOKENS,
                    tp_rank=p,
                    tp_size=P,
                    total_kv_heads=HEADS,
                    decode_tp_size=D,
                )
            t1 = time.perf_counter()
            total = 0
            for d, (cache, ids) in enumerate(ranks("decode", D)):
                res = claim_shards(
                    client,
                    request,
                    cache,
                    ids,
                    tp_rank=d,
                    tp_size=D,
                    prefill_tp_size=P,
                    total_kv_heads=HEADS,
                )
                row["ops"].add(res.copy_ops)
                row["runs"].add(res.source_runs)
                row["shards"].add(len(res.keys))
                total += res.nbytes
            t2 = time.perf_counter()
            assert not client.list(match=f"{request}/.*"), "request not freed after its claims"
            if rep == repeats:
                check_exact(ranks("prefill", P), ranks("decode", D), f"P={P} D={D}")
            if rep:
                row["publish_s"].append(t1 - t0)
                row["claim_s"].append(t2 - t1)
                row["nbytes"] = total
    out = []
    for row in rows.values():
        claim, publish, nbytes = (
            statistics.median(row["claim_s"]),
            statistics.median(row["publish_s"]),
            row["nbytes"],
        )
        out.append(
            {
                "P": row["P"],
                "D": row["D"],
                "bytes_per_request": nbytes,
                "copy_ops_per_claim": sorted(row["ops"]),
                "source_runs_per_claim": sorted(row["runs"]),
                "shards_per_claim": sorted(row["shards"]),
                "claim_seconds_median": claim,
                "claim_GBps": nbytes / claim / 1e9,
                "claim_seconds_all": row["claim_s"],
                "publish_seconds_median": publish,
                "publish_GBps": nbytes / publish / 1e9,
            }
        )
    return out


def check_exact(prefill, decode, label):
    """Every decode rank's tokens equal the prefill ranks' tokens, bit for bit (first and last
    layer: the copies of every layer are the same code)."""

    def tokens(cache, ids, layer):  # [kv, token, head, dim] of one layer, in token order
        c = np.stack([cache.component(layer, k) for k in range(2)])  # [kv, block, slot, head, dim]
        return c[:, ids].reshape(2, TOKENS, c.shape[3], DIM)

    for layer in (0, LAYERS - 1):
        want = np.concatenate([tokens(c, i, layer) for c, i in prefill], axis=2)
        got = np.concatenate([tokens(c, i, layer) for c, i in decode], axis=2)
        assert np.array_equal(want, got), f"{label}: layer {layer} differs"


def main(default_out: str = "tp-cpu.json") -> None:
    from kvbroker.testing import running_daemon

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    torch.set_num_threads(1)  # numpy does the copies; keep torch from competing for 2 cores
    rng = np.random.default_rng(0)
    results = {}
    with running_daemon(pool_size="1G", page_size=None) as daemon:
        with daemon.client() as client:
            for layout in args.layout or sorted(LAYOUTS):
                rows = run_layout(client, LAYOUTS[layout], args.repeats, rng)
                homo = rows[0]["claim_GBps"]
                for row in rows:
                    row["claim_vs_homogeneous"] = row["claim_GBps"] / homo
                    print(
                        f"{layout:17s} P={row['P']} D={row['D']}: "
                        f"{row['copy_ops_per_claim']} copy ops/claim, "
                        f"{row['source_runs_per_claim']} runs/claim, claim "
                        f"{row['claim_GBps']:.2f} GB/s ({row['claim_vs_homogeneous']:.2f}x), "
                        f"publish {row['publish_GBps']:.2f} GB/s",
                        flush=True,
                    )
                results[layout] = rows
    report = {
        "request": {
            "tokens": TOKENS,
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": DIM,
            "dtype": "bfloat16",
            "block_size": BLOCK,
            "block_ids": "scattered",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
        },
        "repeats": args.repeats,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
