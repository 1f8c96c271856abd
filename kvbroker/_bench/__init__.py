"""Benchmarks users can rerun against their own daemon and hardware (``kvbroker bench``).

One module per scenario — transfer, rpc, scale, prefix, tp, gpu, and peer (kvbroker side by
side with Mooncake Store) — each with ``run(...) -> Result`` (rows for a table and JSON,
targets measured as ratios in the same run) and ``plot(result_dict, plt, out_dir)`` for PNG
charts (matplotlib is imported only by :func:`plot_result`, from the ``bench`` extra).
"""

from __future__ import annotations

import importlib

from ._common import (
    Result,
    Target,
    checkout_commit,
    format_table,
    machine_info,
    spawned_daemon,
)

__all__ = [
    "SCENARIOS",
    "Result",
    "Target",
    "checkout_commit",
    "format_table",
    "machine_info",
    "spawned_daemon",
    "scenario",
    "plot_result",
    "MissingMatplotlib",
]

SCENARIOS = ("transfer", "rpc", "scale", "prefix", "tp", "gpu", "peer")


class MissingMatplotlib(RuntimeError):
    """--plot needs matplotlib, which is not installed."""


def scenario(name: str):
    """The module of scenario ``name`` (imported on demand: some need numpy or torch)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    return importlib.import_module(f".{name}", __name__)


def plot_result(result: dict, out_dir: str) -> list[str]:
    """Write the PNG charts of one scenario's result (its JSON form) into ``out_dir``."""
    import os

    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(
            "--plot needs matplotlib: pip install 'kvbroker[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    return scenario(result["scenario"]).plot(result, plt, out_dir)
