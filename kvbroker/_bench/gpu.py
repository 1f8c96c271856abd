"""``kvbroker bench gpu`` (CUDA hosts only): the GPU data path against its limits.

The measurement is :mod:`kvbroker._bench.gpu_run`'s (owned with the GPU code): D2H/H2D publish and
claim through a registered pool against pinned memory, gather/scatter kernels against a
device-to-device copy, and (with two GPUs) the handoff through the daemon's staging rings
against a peer copy. This module runs it in a child process (it starts its own daemon) and turns its
JSON into rows with the ratio of each path to its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from ._common import Result, Target, save_figure

COLUMNS = [
    ("path", "path", "s"),
    ("GBps", "GB/s", ".1f"),
    ("limit", "limit", "s"),
    ("limit_GBps", "limit GB/s", ".1f"),
    ("ratio", "x limit", "ratio"),
]


class NoCuda(RuntimeError):
    """This scenario needs a CUDA GPU and torch built with CUDA."""


def cuda_device() -> str:
    """The name of CUDA device 0; NoCuda when there is none (or no torch)."""
    try:
        import torch
    except ImportError:
        raise NoCuda("the gpu scenario needs torch with CUDA; torch is not installed") from None
    if not torch.cuda.is_available():
        raise NoCuda(f"the gpu scenario needs a CUDA GPU; torch {torch.__version__} sees none")
    return torch.cuda.get_device_name(0)


def rows_from(r: dict) -> list[dict]:
    """Rows (path, GB/s, limit, ratio) from gpu_run's JSON."""
    rows = []
    p = r["pinned"]

    def add(path, value, limit_name, limit):
        rows.append(
            {
                "path": path,
                "GBps": value,
                "limit": limit_name,
                "limit_GBps": limit,
                "ratio": value / limit,
            }
        )

    add("pinned D2H", p["pinned_d2h_GBps"], "pinned D2H", p["pinned_d2h_GBps"])
    add("pinned H2D", p["pinned_h2d_GBps"], "pinned H2D", p["pinned_h2d_GBps"])
    b = r.get("broker")
    if b:
        for label in ("one_buffer", "128_buffers"):
            add(
                f"publish D2H, {label}",
                b[f"publish_d2h_{label}_GBps"],
                "pinned D2H",
                p["pinned_d2h_GBps"],
            )
            add(
                f"claim H2D, {label}",
                b[f"claim_h2d_{label}_GBps"],
                "pinned H2D",
                p["pinned_h2d_GBps"],
            )
    k = r.get("kernels")
    if k:
        for name in ("triton_gather", "triton_scatter", "torch_gather", "torch_scatter"):
            add(name.replace("_", " "), k[f"{name}_GBps"], "D2D copy", k["d2d_copy_GBps"])
    g = r.get("rings")
    if g and "peer_copy_GBps" in g:  # GPU0 -> GPU1 through the daemon's staging rings
        for key, label in (
            ("ring_claim_GBps", "ring claim on the peer GPU"),
            ("ring_zero_copy_handoff_GBps", "ring handoff, written in place"),
            ("ring_end_to_end_GBps", "ring publish + claim"),
        ):
            if key in g:
                add(label, g[key], "peer copy", g["peer_copy_GBps"])
    return rows


def run(socket_path: str | None = None, reps: int = 10, timeout: float = 900.0) -> Result:
    """``socket_path`` is unused: gpu_run starts a daemon sized for its 1 GiB transfers."""
    device = cuda_device()
    with tempfile.TemporaryDirectory(prefix="kvb-gpu-") as d:
        cmd = [
            sys.executable,
            "-m",
            "kvbroker._bench.gpu_run",
            "--out",
            d,
            "--reps",
            str(reps),
            "--name",
            "gpu",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        path = os.path.join(d, "gpu.json")
        if p.returncode != 0 or not os.path.isfile(path):
            raise RuntimeError(
                f"kvbroker._bench.gpu_run exited with {p.returncode}:\n"
                f"{(p.stdout + p.stderr)[-2000:]}"
            )
        with open(path) as f:
            raw = json.load(f)
    rows = rows_from(raw)
    targets = []
    for row in rows:
        if row["path"].startswith(("publish D2H", "claim H2D")):
            targets.append(Target(f"{row['path']} vs pinned", row["ratio"], 0.9))
        elif row["path"].startswith("triton"):
            targets.append(Target(f"{row['path']} vs D2D", row["ratio"], 0.8))
    return Result(
        "gpu",
        rows,
        COLUMNS,
        params={"device": device, "reps": reps, "source": "kvbroker._bench.gpu_run"},
        targets=targets,
        extra={"raw": raw},
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["path"] for r in rows], [r["ratio"] for r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("x its limit (pinned copy, D2D copy or peer copy)")
    ax.set_title(f"GPU data path, {result['params'].get('device', '')}")
    ax.invert_yaxis()
    return [save_figure(fig, plt, out_dir, "gpu.png")]
