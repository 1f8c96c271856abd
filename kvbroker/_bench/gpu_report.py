"""The GPU benchmark's report: :mod:`gpu_run`'s results as a markdown page."""

from __future__ import annotations

from ._common import ratio as _ratio  # two decimals, cut


def markdown(r: dict) -> str:
    p, b, k = r["pinned"], r["broker"], r["kernels"]
    lines = [
        f"# kvbroker GPU data path on {r['device']}",
        "",
        f"commit {r.get('commit', '?')}; `{r.get('command', '?')}`; torch {r['torch']}, "
        f"triton {r['triton']}, CUDA {r['cuda']}; medians.",
        "",
        "| path (1 GiB) | GB/s | × pinned |",
        "|---|---|---|",
        f"| pinned D2H | {p['pinned_d2h_GBps']:.1f} | 1.00 |",
        f"| pinned H2D | {p['pinned_h2d_GBps']:.1f} | 1.00 |",
        f"| pageable D2H | {p['pageable_d2h_GBps']:.1f} | {_ratio(p['pageable_d2h_GBps'] / p['pinned_d2h_GBps'])} |",
        f"| registered pool D2H (DMA only) | {b['registered_d2h_GBps']:.1f} | {_ratio(b['registered_d2h_GBps'] / p['pinned_d2h_GBps'])} |",
        f"| registered pool H2D (DMA only) | {b['registered_h2d_GBps']:.1f} | {_ratio(b['registered_h2d_GBps'] / p['pinned_h2d_GBps'])} |",
    ]
    for label in ("one_buffer", "128_buffers", "128_separate"):
        if f"publish_d2h_{label}_GBps" not in b:
            continue
        pub, cl = b[f"publish_d2h_{label}_GBps"], b[f"claim_h2d_{label}_GBps"]
        n = b.get(f"copies_{label}", "?")  # publish/claim DMAs after merging adjacent runs
        lines.append(
            f"| kvbroker publish D2H, {label} (whole call, {n} DMA) | {pub:.1f} | "
            f"{_ratio(pub / p['pinned_d2h_GBps'])} |"
        )
        lines.append(
            f"| kvbroker claim H2D, {label} (whole call, {n} DMA) | {cl:.1f} | "
            f"{_ratio(cl / p['pinned_h2d_GBps'])} |"
        )
    lines += [
        "",
        f"Pool map {b['map_s'] * 1e3:.0f} ms, cudaHostRegister {b['register_s'] * 1e3:.0f} ms "
        f"(once per process); round trip bit-exact: {b['bit_exact']}.",
        "",
        f"Kernels, shape {k['shape']} (bytes read + written):",
        "",
        "| copy | GB/s | × D2D |",
        "|---|---|---|",
    ]
    d2d = k["d2d_copy_GBps"]
    for name in (
        "d2d_copy_GBps",
        "triton_gather_GBps",
        "triton_scatter_GBps",
        "triton_gather_default_GBps",
        "torch_strided_copy_GBps",
        "torch_gather_GBps",
        "torch_scatter_GBps",
    ):
        lines.append(f"| {name[:-5]} | {k[name]:.0f} | {_ratio(k[name] / d2d)} |")
    lines += [
        "",
        f"Best gather config (tile bytes, warps) {k['best_gather_config']}, "
        f"scatter {k['best_scatter_config']}; gather bit-exact: {k['gather_bit_exact']}.",
        "",
        "Against torch's strided copy of the same selection (`torch_strided_copy`: "
        "the head slice of the same tokens' blocks copied into the staging layout): "
        f"gather {_ratio(k['triton_gather_GBps'] / k['torch_strided_copy_GBps'])}x, "
        f"scatter {_ratio(k['triton_scatter_GBps'] / k['torch_strided_copy_GBps'])}x; "
        f"against the torch fallback (block table): gather "
        f"{k['triton_gather_GBps'] / k['torch_gather_GBps']:.1f}x, scatter "
        f"{k['triton_scatter_GBps'] / k['torch_scatter_GBps']:.1f}x.",
    ]
    if "rings" in r:
        g = r["rings"]
        lines += [
            "",
            f"## GPU0 -> GPU1 handoff through the daemon's ring ({g['nbytes'] >> 20} MiB, "
            f"ring {g['ring_size']}, peer access {g['peer_access']})",
            "",
            "| path | GB/s | × peer copy |",
            "|---|---|---|",
            f"| torch peer copy cuda:0 -> cuda:1 (CUDA events) | {g['peer_copy_GBps']:.1f} | 1.00 |",
            f"| ring_claim on GPU 1 (whole call: RPC, {g['claim_copies']} peer copy, release) | "
            f"{g['ring_claim_GBps']:.1f} | {_ratio(g['ring_claim_GBps'] / g['peer_copy_GBps'])} |",
            f"| ring_publish on GPU 0 (whole call: reserve, D2D into the ring, seal) | "
            f"{g['ring_publish_d2d_GBps']:.1f} | - |",
            f"| publish + claim end to end | {g['ring_end_to_end_GBps']:.1f} | "
            f"{_ratio(g['ring_end_to_end_GBps'] / g['peer_copy_GBps'])} |",
            f"| producer writes into the reserved ring region: reserve + seal + claim "
            f"(the producer's own write not counted) | {g['ring_zero_copy_handoff_GBps']:.1f} | "
            f"{_ratio(g['ring_zero_copy_handoff_GBps'] / g['peer_copy_GBps'])} |",
            "",
            f"Bit-exact: {g['bit_exact']}; ring occupancy after: "
            f"{[x['used'] for x in g['ring_stat_after']]} bytes used.",
        ]
    if "hetero" in r:
        h = r["hetero"]
        lines += [
            "",
            f"## Heterogeneous claim, P=4 -> D=1, {h['shape']}",
            "",
            "| path | copy operations | time (ms) |",
            "|---|---|---|",
            f"| gpu.claim_shards_cuda (DMA per shard into a ring scratch + one Triton "
            f"scatter per shard) | {h['kernel_path_copy_ops']} | "
            f"{h['kernel_path_s'] * 1e3:.2f} |",
        ]
        if "per_token_s" in h:
            lines.append(
                f"| per-token path (one H2D per token, layer, K/V, head) | "
                f"{h['per_token_copy_ops']} | {h['per_token_s'] * 1e3:.0f} |"
            )
            lines += [
                "",
                f"Speed-up {h['speedup']:.0f}x; both bit-exact: "
                f"{h['kernel_path_bit_exact']} / {h['per_token_bit_exact']}.",
            ]
        lines += [
            f"Publish per shard (one gather + {h['publish_copy_ops_per_shard'] - 1} DMA): "
            f"{h['publish_s_per_shard'] * 1e3:.2f} ms for {h['shard_bytes'] >> 20} MiB."
        ]
    if "pytest" in r:
        lines += ["", "CUDA tests: `" + r["pytest"]["summary"] + "`"]
    return "\n".join(lines) + "\n"
