"""The host paths of engine KV, this code against an older tree, side by side: sharded (TP)
publishes and claims, and a prefix load into a vLLM CPU-backend cache, each with its copies
on the copy engine's threads (``CopyEngine.run_jobs``) against one thread.

One private daemon (this tree's: only client code differs); each round runs, once with each
client tree, alternated, each in a fresh process:

- ``kvbroker bench tp``'s measurement (:mod:`kvbroker._bench.tp_request`: one request of 256
  MiB of K+V, P prefill ranks publish, D decode ranks claim, for P=D=1, P=4→1, P=1→4 and
  both decode layouts): claim and publish GB/s;
- the vLLM connector's host load (``_paged.load_host``: match, copy into the cache's blocks,
  release) of ``--load-tokens`` tokens of a Llama-3-8B-shaped KV (32 layers, 8 KV heads,
  head_dim 128, bf16, blocks of 16), saved once beforehand: the median of ``--repeats``
  loads, GB/s, checked bit-exact.

The base tree is a ``kvbroker`` package directory of an older commit (``--make-base REV DIR``
writes one with ``git archive`` and copies this tree's compiled extensions beside it; a device
machine without git gets it carried, and its extensions copied in after the build).

    python benchmarks/ab_host_paths.py --make-base 70510eb .abbase
    python benchmarks/ab_host_paths.py --base .abbase [--rounds 3] [--repeats 3] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _make_base(rev: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "kvbroker"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "kvbroker", "*.so")):
        shutil.copy(so, os.path.join(out, "kvbroker"))
    with open(os.path.join(out, "REV"), "w") as f:
        f.write(
            subprocess.run(
                ["git", "-C", ROOT, "rev-parse", "--short", rev],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )


def _one(tree: str, socket_path: str, repeats: int, load_tokens: int) -> None:
    """In a fresh process: the measurement with ``tree``'s kvbroker (empty: this tree's)."""
    if tree:
        sys.path.insert(0, os.path.abspath(tree))
    import kvbroker
    from kvbroker._bench import tp
    from kvbroker._client.engine import default_engine

    result = tp.run(socket_path, repeats)
    engine = default_engine()
    print(
        json.dumps(
            {
                "package": kvbroker.__file__,
                "threads": engine.threads,
                "gated": engine.split_while is not None,
                "load_GBps": _vllm_host_load(socket_path, repeats, load_tokens),
                "rows": [
                    {k: r[k] for k in ("layout", "P", "D", "claim_GBps", "publish_GBps")}
                    for r in result.rows
                ],
            }
        )
    )


def _vllm_host_load(socket_path: str, repeats: int, tokens: int) -> float:
    """GB/s of the median of ``repeats`` vLLM host loads of ``tokens`` tokens."""
    import statistics
    import time

    import torch

    from kvbroker import Client
    from kvbroker.integrations.vllm._format import BlockFormat
    from kvbroker.integrations.vllm._paged import HostSave, SaveItem, host_cache, load_host

    layers, heads, dim, block = 32, 8, 128, 16
    blocks = tokens // block
    fmt = BlockFormat(
        dtype="bfloat16",
        num_layers=layers,
        block_size=block,
        head_dim=dim,
        local_heads=heads,
        total_kv_heads=heads,
        tp_rank=0,
        tp_size=1,
        heads=(0, heads),
    )
    shape = (layers, blocks, heads, block, 2 * dim)  # the CPU backend's [L][B][H][2·N... ]
    src_raw = torch.randint(-30000, 30000, (torch.Size(shape).numel(),), dtype=torch.int16)
    dst_raw = torch.zeros_like(src_raw)
    src, dst = (
        host_cache(list(r.view(shape).view(torch.bfloat16)), "cpu") for r in (src_raw, dst_raw)
    )
    ns = f"vllm/ab-{os.getpid()}"
    hashes = [f"{os.getpid():016x}{i:016x}" for i in range(blocks)]
    items = [SaveItem(h, hashes[i - 1] if i else None, i) for i, h in enumerate(hashes)]
    with Client(socket_path, name="ab-host-paths") as client:
        save = HostSave(client, ns, fmt, src, items)
        save.reserve()
        for layer in range(layers):
            save.copy_layer(layer)
        save.seal()
        times = []
        try:
            for _ in range(repeats + 1):  # the first warms the mappings and is dropped
                dst_raw.zero_()
                t = time.perf_counter()
                if load_host(client, ns, fmt, dst, hashes, list(range(blocks))) != blocks:
                    raise AssertionError("the load found fewer blocks than were saved")
                times.append(time.perf_counter() - t)
                if not torch.equal(dst_raw, src_raw):
                    raise AssertionError("the loaded blocks differ from the saved ones")
        finally:
            client.evict(namespace=ns, all=True)
    return blocks * fmt.block_nbytes / statistics.median(times[1:]) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-base", nargs=2, metavar=("REV", "DIR"))
    ap.add_argument("--base", metavar="DIR", help="a tree made by --make-base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    ap.add_argument("--load-tokens", type=int, default=4096)
    ap.add_argument(
        "--one", nargs=4, metavar=("TREE", "SOCKET", "REPEATS", "TOKENS"), help=argparse.SUPPRESS
    )
    a = ap.parse_args(argv)
    if a.make_base:
        _make_base(*a.make_base)
        return 0
    if a.one:
        _one(a.one[0], a.one[1], int(a.one[2]), int(a.one[3]))
        return 0
    if not a.base:
        ap.error("--base DIR (a tree made by --make-base) is required")

    from kvbroker._bench._common import invocation, machine_info, measured_commit, median
    from kvbroker._bench._common import spawned_daemon, write_results

    with open(os.path.join(a.base, "REV")) as f:
        base_rev = f.read().strip()
    variants = {"this code": "", f"base {base_rev}": a.base}
    runs = []
    with spawned_daemon("2G") as sock:
        for rnd in range(1, a.rounds + 1):
            for name, tree in variants.items():
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        tree,
                        sock,
                        str(a.repeats),
                        str(a.load_tokens),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                got = json.loads(out.strip().splitlines()[-1])
                if tree and not got["package"].startswith(os.path.abspath(tree)):
                    raise RuntimeError(f"the base run imported {got['package']}")
                runs.append({"round": rnd, "variant": name, **got})
                print(
                    f"round {rnd} {name}: vllm host load {got['load_GBps']:.2f} GB/s; "
                    + "; ".join(
                        f"{r['layout']} P={r['P']}→{r['D']} claim {r['claim_GBps']:.2f} publish "
                        f"{r['publish_GBps']:.2f} GB/s"
                        for r in got["rows"]
                    ),
                    flush=True,
                )
    base, new = list(variants)[1], list(variants)[0]

    def compare(value) -> dict:
        """``value(run)`` of each run: medians per variant, this code / base per round."""
        by = {(run["round"], run["variant"]): value(run) for run in runs}
        return {
            "this code": median([v for (_, n), v in by.items() if n == new]),
            "base": median([v for (_, n), v in by.items() if n == base]),
            "x_base_per_round": [by[r, new] / by[r, base] for r in range(1, a.rounds + 1)],
        }

    def row_of(run, cfg):
        return next(r for r in run["rows"] if (r["layout"], r["P"], r["D"]) == cfg)

    summary = [
        {
            "layout": cfg[0],
            "P": cfg[1],
            "D": cfg[2],
            **{
                what: compare(lambda run, cfg=cfg, what=what: row_of(run, cfg)[what])
                for what in ("claim_GBps", "publish_GBps")
            },
        }
        for cfg in [(r["layout"], r["P"], r["D"]) for r in runs[0]["rows"]]
    ]
    load = compare(lambda run: run["load_GBps"])
    result = {
        "benchmark": "ab_host_paths",
        "commit": measured_commit(),
        "base": base_rev,
        "command": invocation(),
        "machine": machine_info(),
        "rounds": a.rounds,
        "repeats": a.repeats,
        "threads": runs[0]["threads"],
        "gated": runs[0]["gated"],
        "load_tokens": a.load_tokens,
        "runs": runs,
        "summary": summary,
        "vllm_host_load": load,
    }
    write_results(a.out, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    from kvbroker._bench._common import ratio_span

    m = result["machine"]

    out = [
        f"# Host paths of engine KV: this code against {result['base']} "
        f"({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min'):.2f}; "
        f"`{result['command']}`; the copy engine on {result['threads']} thread(s)"
        f"{' (gated: a second only while a CPU is left idle)' if result['gated'] else ''}; "
        f"{result['rounds']} rounds alternated, each the median of {result['repeats']} "
        "requests of 256 MiB.",
        "",
        "| decode layout | P→D | claim GB/s this / base | claim × base per round: median "
        "(range) | publish GB/s this / base | publish × base per round |",
        "|---|---|---|---|---|---|",
    ]
    for e in result["summary"]:
        c, p = e["claim_GBps"], e["publish_GBps"]
        out.append(
            f"| {e['layout']} | {e['P']}→{e['D']} | {c['this code']:.2f} / {c['base']:.2f}"
            f" | {ratio_span(c['x_base_per_round'])} | "
            f"{p['this code']:.2f} / {p['base']:.2f} | "
            f"{ratio_span(p['x_base_per_round'])} |"
        )
    ld = result["vllm_host_load"]
    out += [
        "",
        f"vLLM connector, host load of {result['load_tokens']} tokens of a "
        "Llama-3-8B-shaped KV (`_paged.load_host`, bit-exact): "
        f"{ld['this code']:.2f} GB/s against {ld['base']:.2f}, × base per round "
        f"{ratio_span(ld['x_base_per_round'])}.",
        "",
        "× above 1: faster than the base; ratios cut to two decimals.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
