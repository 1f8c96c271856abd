"""``kvbroker bench peer``: kvbroker and Mooncake Store side by side, in one session.

Each round runs the peer script (``benchmarks/mooncake_peer.py`` of the source tree, in the
Python environment that has Mooncake installed; it starts and stops its own master and client
daemon; set-up in docs/operating.md, "Comparing with Mooncake") and, right after it, kvbroker's
``transfer`` scenario on the same sizes with the same number of operations. Both time the
same loop, one object at a time: put a key, get it, drop it. The peer reports medians of
``ops`` puts and ``ops`` gets per size and mode; kvbroker the medians of its put and get.
Compared: the put+get round trip (sum of the two medians) and publish+claim GB/s (2 × size
over that time), as ratios per Mooncake mode. With several rounds the table shows the median
of the rounds and the JSON the range.

Beside memcpy (one thread, timed in the same loop), kvbroker's put+get is compared with a
multi-threaded memcpy of the same bytes, copied twice (a put and a get), each copy split over
the threads the host copy engine uses for that size (:class:`transfer.SplitMemcpy`): the
limit on a machine where the engine runs several threads. Without ``python`` (no Mooncake
installed) only kvbroker's side and these baselines are measured; the Mooncake columns and
targets are left out.

The peer's output is a JSON list of ``{mode, setup_s, sizes: [{size, put: {median_ms, ...},
get: {median_ms, ...}, data_ok, errors}]}`` (``--json-out``); anything speaking that shape
can stand in for it. A size with errors, or whose bytes came back wrong, fails the run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile

from ._common import KiB, MiB, Result, Target, save_figure

DEFAULT_SIZES = (256 * KiB, 4 * MiB, 32 * MiB)
DEFAULT_MODES = ("dummy", "embedded")
COLUMNS = [
    ("size", "size", "size"), ("kvb_put_ms", "kvb put ms", ".3f"),
    ("kvb_get_ms", "kvb get ms", ".3f"), ("kvb_roundtrip_ms", "kvb put+get ms", ".3f"),
    ("kvb_vs_memcpy", "kvb x memcpy", "ratio"), ("copy_threads", "threads", ".0f"),
    ("kvb_vs_split_memcpy", "kvb x memcpy same threads", "ratio"),
]  # fmt: skip


class PeerFailed(RuntimeError):
    """The peer benchmark did not produce results."""


PEER_SCRIPT = os.path.join("benchmarks", "mooncake_peer.py")  # in the source tree


def default_peer_script() -> str:
    """``$KVBROKER_PEER_SCRIPT``, else benchmarks/mooncake_peer.py of the source tree this
    package runs from; PeerFailed where there is none (an installed package)."""
    env = os.environ.get("KVBROKER_PEER_SCRIPT")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, PEER_SCRIPT)
    if not os.path.isfile(path):
        raise PeerFailed(f"no {PEER_SCRIPT} beside this kvbroker ({root} is not a source tree): "
                         "pass --peer-script FILE, the driver from kvbroker's repository")  # fmt: skip
    return path


def run_peer(python: str, script: str, sizes, modes, ops: int, timeout: float) -> list[dict]:
    """Run the peer script once; its parsed JSON (one entry per mode)."""
    if not os.path.isfile(script):
        raise PeerFailed(f"peer script not found: {script}")
    with tempfile.TemporaryDirectory(prefix="kvb-peer-") as d:
        out = os.path.join(d, "peer.json")
        cmd = [python, script, "--modes", ",".join(modes), "--sizes",
               ",".join(str(s) for s in sizes), "--ops", str(ops), "--json-out", out,
               "--workdir", os.path.join(d, "run"), "--budget", str(max(10.0, timeout - 10))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerFailed(f"peer benchmark did not run: {exc}") from None
        if p.returncode != 0 or not os.path.isfile(out):
            tail = (p.stdout + p.stderr)[-2000:]
            raise PeerFailed(f"peer benchmark exited with {p.returncode}:\n{tail}")
        with open(out) as f:
            results = json.load(f)
    by_mode = {r.get("mode"): r for r in results}
    for mode in modes:
        r = by_mode.get(mode)
        if r is None or "error" in r:
            raise PeerFailed(f"peer mode {mode!r} failed: {r and r.get('error')}")
        for z in r["sizes"]:
            complete = z.get("put") and z.get("get") and not z.get("errors")
            if not complete or not z.get("data_ok", True):
                raise PeerFailed(f"peer mode {mode!r} size {z['size']}: {z.get('errors')}")
    return results


def compare(peer: list[dict], kvb_rows: list[dict], modes) -> list[dict]:
    """One row per size: kvbroker's medians beside each peer mode's, with ratios."""
    by_mode = {r["mode"]: {z["size"]: z for z in r["sizes"]} for r in peer}
    rows = []
    for k in kvb_rows:
        size = k["size"]
        kvb_rt = (k["put_p50_us"] + k["get_p50_us"]) / 1e3
        row = {
            "size": size, "kvb_put_ms": k["put_p50_us"] / 1e3, "kvb_get_ms": k["get_p50_us"] / 1e3,
            "kvb_roundtrip_ms": kvb_rt, "kvb_gbps": 2 * size / (kvb_rt / 1e3) / 1e9,
            "memcpy_gbps": k["memcpy_gbps"], "kvb_vs_memcpy": k["ratio_vs_memcpy"],
            "copy_threads": k["copy_threads"], "split_memcpy2_ms": k["split_memcpy2_p50_us"] / 1e3,
            "split_memcpy_gbps": 2 * size / (k["split_memcpy2_p50_us"] / 1e6) / 1e9,
            "kvb_vs_split_memcpy": k["ratio_vs_split_memcpy"],
        }  # fmt: skip
        for mode in modes:
            z = by_mode[mode][size]
            rt = z["put"]["median_ms"] + z["get"]["median_ms"]
            row[f"{mode}_put_ms"] = z["put"]["median_ms"]
            row[f"{mode}_get_ms"] = z["get"]["median_ms"]
            row[f"{mode}_roundtrip_ms"] = rt
            row[f"{mode}_gbps"] = 2 * size / (rt / 1e3) / 1e9
            # > 1: kvbroker moves the bytes faster; time ratio < 1: kvbroker takes less time.
            row[f"speedup_vs_{mode}"] = rt / kvb_rt
            row[f"time_vs_{mode}"] = kvb_rt / rt
        rows.append(row)
    return rows


def _median_rows(rounds: list[list[dict]]) -> list[dict]:
    out = []
    for per_size in zip(*rounds):
        row = {"size": per_size[0]["size"], "rounds": len(per_size)}
        for key in per_size[0]:
            if key == "size":
                continue
            vals = [r[key] for r in per_size]
            row[key] = statistics.median(vals)
            if key.startswith(("speedup_vs_", "time_vs_", "kvb_vs_")):
                row[key + "_range"] = [min(vals), max(vals)]
        out.append(row)
    return out


def targets(rows: list[dict], modes) -> list[Target]:
    out = []
    for row in rows:
        if row["size"] == 32 * MiB:
            out.append(Target("32 MiB publish+claim vs memcpy", row["kvb_vs_memcpy"], 0.9))
            out.append(Target("32 MiB put+get vs multi-threaded memcpy, same threads",
                              row["kvb_vs_split_memcpy"], 0.8, fmt="ratio"))  # fmt: skip
            if "dummy" in modes:
                out.append(Target("32 MiB publish+claim GB/s vs Mooncake dummy",
                                  row["speedup_vs_dummy"], 1.2))  # fmt: skip
        if row["size"] == 256 * KiB and "dummy" in modes:
            out.append(Target("256 KiB put+get time vs Mooncake dummy",
                              row["time_vs_dummy"], 1 / 3, "<="))  # fmt: skip
    return out


def run(socket_path: str, python: str | None, script: str | None = None, sizes=DEFAULT_SIZES,
        modes=DEFAULT_MODES, ops: int = 50, rounds: int = 1, peer_timeout: float = 180.0
        ) -> Result:  # fmt: skip
    """``python`` None: Mooncake is not run (``modes`` ignored), kvbroker against memcpy only."""
    from .._client.engine import default_engine
    from . import transfer

    if python is None:
        modes = ()
    else:
        script = script or default_peer_script()
    rounds_rows, raw = [], []
    for _ in range(rounds):
        peer = run_peer(python, script, sizes, modes, ops, peer_timeout) if modes else []
        kvb = transfer.measure(socket_path, sizes, reps=ops, split_baseline=True)
        raw.append({"peer": peer, "kvbroker": kvb})
        rounds_rows.append(compare(peer, kvb, modes))
    rows = _median_rows(rounds_rows)
    cols = list(COLUMNS)
    for mode in modes:
        cols += [(f"{mode}_roundtrip_ms", f"{mode} put+get ms", ".3f"),
                 (f"speedup_vs_{mode}", f"x {mode}", "ratio")]  # fmt: skip
    peer_versions = {r["mode"]: {"setup_s": r.get("setup_s"), "mooncake": r.get("mooncake")}
                     for r in raw[-1]["peer"]}  # fmt: skip
    notes = ["x memcpy same threads: two memcpys of the bytes, each split over that many "
             "threads as the copy engine splits it / kvbroker's put+get time."]  # fmt: skip
    if modes:
        notes.append("x MODE: Mooncake's put+get time / kvbroker's (above 1: kvbroker is faster).")
    else:
        notes.append("Mooncake not run (no --mooncake-python): kvbroker against memcpy only.")
    return Result(
        "peer", rows, cols,
        params={"sizes": list(sizes), "modes": list(modes), "ops": ops, "rounds": rounds,
                "peer_script": os.path.abspath(script) if modes else None, "peer_python": python,
                "copy_engine_threads": default_engine().threads},
        targets=targets(rows, modes), extra={"raw_rounds": raw, "peer_modes": peer_versions},
        notes=notes,
    )  # fmt: skip


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    modes = result["params"]["modes"]
    labels = [f"{r['size'] >> 10} KiB" if r["size"] < MiB else f"{r['size'] >> 20} MiB"
              for r in rows]  # fmt: skip
    series = [("kvbroker", "kvb_gbps")] + [(f"Mooncake {m}", f"{m}_gbps") for m in modes]
    # put+get copies each byte twice, and so does the "GB/s" here: the limit is memcpy's rate
    series.append(("memcpy, same run (the limit)", "memcpy_gbps"))
    if all("split_memcpy_gbps" in r for r in rows):  # results from before the baseline lack it
        series.append(("memcpy, engine's threads", "split_memcpy_gbps"))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        vals = [r[key] for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels(labels)
    ax.set_ylabel("put+get GB/s (2 x size / round trip)")
    ax.set_title("kvbroker vs Mooncake Store, same session")
    ax.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "peer.png")]
