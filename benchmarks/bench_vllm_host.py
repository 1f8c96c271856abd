"""The vLLM connector's host data path (vLLM's CPU backend), with and without checksums.

For a Llama-3-8B-shaped KV of ``--tokens`` tokens (32 layers, 8 KV heads, head_dim 128, bf16)
in a vLLM 0.32 CPU-backend cache (block size 16), side by side in one process and run,
alternated over ``--rounds``:

- **save** of every block as the worker does it (``_paged.HostSave``: reserve, one
  ``copy_layer`` per layer, seal), sealed with checksums (the default: every block hashed
  at seal over the copy engine's threads) and without (``HostSave(checksums=False)``): the
  cost of integrity on this path;
- **load** of every block (``_paged.load_host``: match, copy into the cache's blocks,
  release), checked bit-exact;
- a plain copy of the same bytes (``numpy.copyto`` of one contiguous array of that size, the
  median of 3), the floor of any save or load.

It starts its own private daemon and writes ``PREFIX.json`` and ``PREFIX.md`` with the commit,
the machine and the command line.

    python benchmarks/bench_vllm_host.py [--tokens 4096] [--rounds 4] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvbroker import Client
from kvbroker._bench._common import invocation, machine_info, measured_commit, median
from kvbroker._bench._common import ratio_span, spawned_daemon, write_results
from kvbroker._client.engine import default_engine
from kvbroker.integrations.vllm._format import BlockFormat
from kvbroker.integrations.vllm._paged import HostSave, SaveItem, host_cache, load_host

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
VARIANTS = ("save_checksums", "save_no_checksums")


def _cache(blocks: int, seed: int):
    """Per-layer ``[blocks, heads, 2, page, dim]`` bf16 views of one allocation (the CPU
    backend's layout: each (block, head) holds its K rows, then its V rows)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        -30000, 30000, (LAYERS * blocks * HEADS * BLOCK * 2 * DIM,), generator=g, dtype=torch.int16
    )
    five = raw.view(LAYERS, blocks, HEADS, BLOCK, 2 * DIM).view(torch.bfloat16)
    return [five[i] for i in range(LAYERS)], raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the copies are numpy's and the copy engine's
    blocks = a.tokens // BLOCK
    fmt = BlockFormat(
        dtype="bfloat16",
        num_layers=LAYERS,
        block_size=BLOCK,
        head_dim=DIM,
        local_heads=HEADS,
        total_kv_heads=HEADS,
        tp_rank=0,
        tp_size=1,
        heads=(0, HEADS),
    )
    nbytes = blocks * fmt.block_nbytes
    src_layers, src_raw = _cache(blocks, 0)
    dst_layers, dst_raw = _cache(blocks, 1)
    src, dst = host_cache(src_layers, "cpu"), host_cache(dst_layers, "cpu")
    flat_a = np.zeros(nbytes, np.uint8)
    flat_b = np.ones(nbytes, np.uint8)
    np.copyto(flat_a, flat_b)  # (its pages faulted in before the first timed copy)
    rows = []
    pool = f"{(nbytes >> 30) + 1}G"  # one save at a time: each is evicted before the next
    with spawned_daemon(pool) as sock, Client(sock, name="bench-vllm-host") as client:
        for rnd in range(1, a.rounds + 1):
            row = {"round": rnd}
            for v, variant in enumerate(VARIANTS):
                ns = f"vllm/bench-{rnd}-{v}"
                hashes = [f"{rnd:08x}{v:08x}{i:016x}" for i in range(blocks)]
                items = [SaveItem(h, hashes[i - 1] if i else None, i) for i, h in enumerate(hashes)]
                t = time.perf_counter()
                save = HostSave(
                    client, ns, fmt, src, items, checksums=variant != "save_no_checksums"
                )
                save.reserve()
                for layer in range(LAYERS):
                    save.copy_layer(layer)
                save.seal()
                row[variant] = time.perf_counter() - t
                if variant == "save_checksums":
                    dst_raw.zero_()
                    t = time.perf_counter()
                    got = load_host(client, ns, fmt, dst, hashes, list(range(blocks)))
                    row["load"] = time.perf_counter() - t
                    if got != blocks or not torch.equal(dst_raw, src_raw):
                        raise AssertionError("the loaded blocks differ from the saved ones")
                client.evict(namespace=ns, all=True)
            copies = []
            for _ in range(3):
                t = time.perf_counter()
                np.copyto(flat_a, flat_b)
                copies.append(time.perf_counter() - t)
            row["copy"] = median(copies)
            rows.append(row)
            print(
                f"round {rnd}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items() if k != "round"),
                flush=True,
            )
    keys = [*VARIANTS, "load", "copy"]
    med = {k: median([r[k] for r in rows]) for k in keys}
    result = {
        "benchmark": "bench_vllm_host",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "tokens": a.tokens,
        "nbytes": nbytes,
        "copy_threads": default_engine().threads,
        "rounds": rows,
        "median_s": med,
        "checksums_over_none_per_round": [
            r["save_checksums"] / r["save_no_checksums"] for r in rows
        ],
        "copy_over_save_per_round": [r["copy"] / r["save_checksums"] for r in rows],
        "copy_over_load_per_round": [r["copy"] / r["load"] for r in rows],
    }
    write_results(a.out, result, markdown(result))
    return 0


def markdown(r: dict) -> str:
    m = r["machine"]

    med = r["median_s"]
    return "\n".join(
        [
            f"# vLLM connector, host path: {r['tokens']} tokens of a Llama-3-8B-shaped KV "
            f"({r['nbytes'] / 2**20:.0f} MiB; {m.get('cpu')}, {m.get('cores')} cores)",
            "",
            f"commit {r['commit']}, {m.get('when')}; load {m.get('loadavg_1min'):.2f}; "
            f"`{r['command']}`; the copy engine on {r['copy_threads']} thread(s); "
            f"{len(r['rounds'])} rounds alternated.",
            "",
            "| step | median ms | per round |",
            "|---|---|---|",
            f"| save, checksums on (the default) | {med['save_checksums'] * 1e3:.1f} | × checksums "
            "off: "
            f"{ratio_span(r['checksums_over_none_per_round'])} |",
            f"| save, checksums off | {med['save_no_checksums'] * 1e3:.1f} | |",
            f"| load | {med['load'] * 1e3:.1f} | a copy / it: "
            f"{ratio_span(r['copy_over_load_per_round'])} |",
            f"| one copy of the bytes (numpy) | {med['copy'] * 1e3:.1f} | a copy / save with "
            f"checksums: {ratio_span(r['copy_over_save_per_round'])} |",
            "",
            "Ratios cut to two decimals.",
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
