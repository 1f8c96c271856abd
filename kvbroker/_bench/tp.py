"""``kvbroker bench tp``: heterogeneous against homogeneous tensor-parallel claims.

The measurement is :mod:`kvbroker._bench.tp_request`'s (owned with the TP code; see its
docstring for the request shape): this module calls its ``run_layout`` for every (P prefill
ranks → D decode ranks) configuration and layout, against the daemon given, and
reports copy operations per claim, claim GB/s and the ratio to the homogeneous P=D=1 claim.
"""

from __future__ import annotations

import importlib
import importlib.util

from ._common import Result, Target, save_figure

COLUMNS = [
    ("layout", "decode layout", "s"),
    ("P", "P", "d"),
    ("D", "D", "d"),
    ("copy_ops", "copies/claim", "s"),
    ("source_runs", "runs/claim", "s"),
    ("claim_GBps", "claim GB/s", ".2f"),
    ("claim_vs_homogeneous", "x P=D=1", "ratio"),
    ("publish_GBps", "publish GB/s", ".2f"),
]


class NoTorch(RuntimeError):
    """This scenario needs torch (``pip install 'kvbroker[torch]'``)."""


def load_bench_tp():
    """:mod:`kvbroker._bench.tp_request` (it needs torch: NoTorch without it)."""
    if importlib.util.find_spec("torch") is None:
        raise NoTorch("the tp scenario needs torch: pip install 'kvbroker[torch]'")
    return importlib.import_module("kvbroker._bench.tp_request")


def run(socket_path: str, repeats: int = 5, layouts=None, shape: dict | None = None) -> Result:
    """``shape``: overrides of bench_tp's request constants (LAYERS, HEADS, DIM, TOKENS,
    BLOCK), for quick runs; the default is its full request (256 MiB of K+V)."""
    import numpy as np
    import torch

    from .. import Client

    bt = load_bench_tp()
    for name, value in (shape or {}).items():
        if not hasattr(bt, name):
            raise ValueError(f"bench_tp has no request constant {name}")
        setattr(bt, name, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # numpy does the copies; keep torch off the other cores
    rng = np.random.default_rng(0)
    rows = []
    try:
        with Client(socket_path, name="bench-tp", role="bench") as c:
            for layout in layouts or sorted(bt.LAYOUTS):
                axes = bt.LAYOUTS[layout]
                if hasattr(bt, "run_layout"):  # every configuration, interleaved per repeat
                    got = bt.run_layout(c, axes, repeats, rng)
                else:
                    got = [bt.run_config(c, P, D, axes, repeats, rng) for P, D in bt.CONFIGS]
                homo = next(r for r in got if r["P"] == r["D"] == 1)["claim_GBps"]
                for r in got:
                    rows.append(
                        {
                            "layout": layout,
                            "P": r["P"],
                            "D": r["D"],
                            "bytes_per_request": r["bytes_per_request"],
                            "copy_ops": "/".join(map(str, r["copy_ops_per_claim"])),
                            "source_runs": "/".join(map(str, r["source_runs_per_claim"])),
                            "copy_ops_per_claim": r["copy_ops_per_claim"],
                            "claim_GBps": r["claim_GBps"],
                            "claim_vs_homogeneous": r["claim_GBps"] / homo,
                            "publish_GBps": r["publish_GBps"],
                        }
                    )
    finally:
        torch.set_num_threads(threads)
    targets = [
        Target(
            f"{r['layout']} P={r['P']}→D={r['D']} claim vs P=D=1", r["claim_vs_homogeneous"], 0.8
        )
        for r in rows
        if (r["P"], r["D"]) != (1, 1)
    ]
    request = {k: getattr(bt, k) for k in ("LAYERS", "HEADS", "DIM", "TOKENS", "BLOCK")}
    return Result(
        "tp",
        rows,
        COLUMNS,
        params={"repeats": repeats, "request": request, "source": "kvbroker._bench.tp_request"},
        targets=targets,
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    layouts = sorted({r["layout"] for r in rows})
    configs = sorted({(r["P"], r["D"]) for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(1, len(layouts))
    for i, layout in enumerate(layouts):
        by = {(r["P"], r["D"]): r["claim_GBps"] for r in rows if r["layout"] == layout}
        ax.bar(
            [j + i * width for j in range(len(configs))],
            [by.get(c, 0) for c in configs],
            width,
            label=layout,
        )
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(configs))])
    ax.set_xticklabels([f"P={p}→D={d}" for p, d in configs])
    ax.set_ylabel("claim GB/s")
    ax.set_title("heterogeneous vs homogeneous TP claims")
    ax.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "tp.png")]
