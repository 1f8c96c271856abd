"""``kvbroker bench peer``: kvbroker, Mooncake Store and LMCache side by side, in one session.

Each round runs the peers' drivers, each in the Python environment that has that peer
installed — ``benchmarks/mooncake_peer.py`` (``--mooncake-python``; it starts and stops its own
master and client daemon; set-up in docs/operating.md, "Comparing with Mooncake") and
``benchmarks/lmcache_peer.py`` (``--lmcache-python``; it starts and stops its own ``lmcache
server`` in ``engine_driven`` mode with a shared-memory segment; "Comparing with LMCache") —
and, right after them, kvbroker's ``transfer`` scenario on the same sizes with the same number
of operations. All time the same loop, one object at a time: put a key, get it, drop it. A
driver reports medians of ``ops`` puts and ``ops`` gets per size and mode; kvbroker the
medians of its put and get. LMCache stores KV caches, not opaque objects: its object is one
chunk of a paged float16 KV cache of that size, and its get is the lookup (which prefetches
and locks the chunk) and the retrieve, as its engine adapters do it.

Compared: the put+get round trip (the sum of the put and the get medians) and publish+claim
GB/s (2 × size over that time), as ratios per peer mode. Every ratio is the quotient of two
times the table shows beside it: with several rounds, each time is its median over the
rounds and each ratio the quotient of those medians (:func:`derive`); the per-round ratios go
to ``KEY_range`` (least, most) in the JSON.

Beside memcpy (one thread, timed in the same loop), kvbroker's put+get is compared with a
multi-threaded memcpy of the same bytes, copied twice (a put and a get), each copy split over
the threads the host copy engine uses for that size (:class:`transfer.SplitMemcpy`): the
limit on a machine where the engine runs several threads. Without a peer's Python that peer
is left out; with none, only kvbroker's side and these baselines are measured.

A driver's output is a JSON list of ``{mode, setup_s, sizes: [{size, put: {median_ms, ...},
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
LMCACHE_MODE = "engine_driven"  # the driver's one mode; its columns are named "lmcache"
KVCR_MODE = "local_dram"  # the driver's one mode; its columns are named "kvcr"
LABELS = {
    "dummy": "Mooncake dummy",
    "embedded": "Mooncake embedded",
    "tcp": "Mooncake tcp",
    "lmcache": "LMCache",
    "kvcr": "KVCR local DRAM",
}
COLUMNS = [
    ("size", "size", "size"),
    ("kvb_put_ms", "kvb put ms", ".3f"),
    ("kvb_get_ms", "kvb get ms", ".3f"),
    ("kvb_roundtrip_ms", "kvb put+get ms", ".3f"),
    ("memcpy_ms", "memcpy ms", ".3f"),
    ("kvb_vs_memcpy", "kvb x memcpy", "ratio"),
    ("copy_threads", "threads", ".0f"),
    ("split_memcpy2_ms", "2 memcpys, same threads ms", ".3f"),
    ("kvb_vs_split_memcpy", "kvb x memcpy same threads", "ratio"),
]
# The times a row is made of; every other figure of a row is derived from them (derive).
TIMES = ("kvb_put_ms", "kvb_get_ms", "memcpy_ms", "split_memcpy2_ms")


def columns(modes) -> list[tuple[str, str, str]]:
    """The table's columns for these peer modes: each ratio beside the two times it divides."""
    cols = list(COLUMNS)
    for mode in modes:
        label = LABELS.get(mode, mode)
        cols += [
            (f"{mode}_roundtrip_ms", f"{label} put+get ms", ".3f"),
            (f"speedup_vs_{mode}", f"x {label}", "ratio"),
            # the memcpy its driver timed in its own loop: what the machine gave that
            # peer's turn, beside kvbroker's "memcpy ms" (load moves between turns)
            (f"{mode}_memcpy_ms", f"{label}'s turn: memcpy ms", ".3f"),
        ]
    return cols


class PeerFailed(RuntimeError):
    """The peer benchmark did not produce results."""


PEER_SCRIPT = os.path.join("benchmarks", "mooncake_peer.py")  # in the source tree
LMCACHE_SCRIPT = os.path.join("benchmarks", "lmcache_peer.py")
KVCR_SCRIPT = os.path.join("benchmarks", "kvcr_peer.py")
OPTIONS = {
    PEER_SCRIPT: "--peer-script",
    LMCACHE_SCRIPT: "--lmcache-script",
    KVCR_SCRIPT: "--kvcr-script",
}


def default_peer_script(name: str = PEER_SCRIPT) -> str:
    """The driver ``name`` of the source tree this package runs from (Mooncake's:
    ``$KVBROKER_PEER_SCRIPT`` first); PeerFailed where there is none (an installed package)."""
    env = os.environ.get("KVBROKER_PEER_SCRIPT") if name == PEER_SCRIPT else None
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        option = OPTIONS.get(name, "--peer-script")
        raise PeerFailed(
            f"no {name} beside this kvbroker ({root} is not a source tree): "
            f"pass {option} FILE, the driver from kvbroker's repository"
        )
    return path


def run_peer(python: str, script: str, sizes, modes, ops: int, timeout: float) -> list[dict]:
    """Run the peer script once; its parsed JSON (one entry per mode)."""
    if not os.path.isfile(script):
        raise PeerFailed(f"peer script not found: {script}")
    with tempfile.TemporaryDirectory(prefix="kvb-peer-") as d:
        out = os.path.join(d, "peer.json")
        cmd = [
            python,
            script,
            "--modes",
            ",".join(modes),
            "--sizes",
            ",".join(str(s) for s in sizes),
            "--ops",
            str(ops),
            "--json-out",
            out,
            "--workdir",
            os.path.join(d, "run"),
            "--budget",
            str(max(10.0, timeout - 10)),
        ]
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


def derive(row: dict, modes) -> dict:
    """Complete ``row`` from its times (:data:`TIMES`, each peer mode's ``MODE_put_ms`` and
    ``MODE_get_ms``): round trips, GB/s and ratios, each a quotient of times of the row."""
    size = row["size"]
    kvb_rt = row["kvb_put_ms"] + row["kvb_get_ms"]
    row["kvb_roundtrip_ms"] = kvb_rt
    row["kvb_gbps"] = 2 * size / (kvb_rt / 1e3) / 1e9
    row["memcpy_gbps"] = size / (row["memcpy_ms"] / 1e3) / 1e9
    # put+get moves the bytes twice; memcpy once: two memcpys are the physical limit
    row["kvb_vs_memcpy"] = 2 * row["memcpy_ms"] / kvb_rt
    if row.get("split_memcpy2_ms") is not None:
        row["split_memcpy_gbps"] = 2 * size / (row["split_memcpy2_ms"] / 1e3) / 1e9
        row["kvb_vs_split_memcpy"] = row["split_memcpy2_ms"] / kvb_rt
    for mode in modes:
        rt = row[f"{mode}_put_ms"] + row[f"{mode}_get_ms"]
        row[f"{mode}_roundtrip_ms"] = rt
        row[f"{mode}_gbps"] = 2 * size / (rt / 1e3) / 1e9
        # > 1: kvbroker moves the bytes faster; time ratio < 1: kvbroker takes less time.
        row[f"speedup_vs_{mode}"] = rt / kvb_rt
        row[f"time_vs_{mode}"] = kvb_rt / rt
    return row


def compare(peer: list[dict], kvb_rows: list[dict], modes) -> list[dict]:
    """One row per size: kvbroker's medians beside each peer mode's, with ratios."""
    by_mode = {r["mode"]: {z["size"]: z for z in r["sizes"]} for r in peer}
    rows = []
    for k in kvb_rows:
        size = k["size"]
        row = {
            "size": size,
            "kvb_put_ms": k["put_p50_us"] / 1e3,
            "kvb_get_ms": k["get_p50_us"] / 1e3,
            "memcpy_ms": k["memcpy_p50_us"] / 1e3,
            "copy_threads": k["copy_threads"],
            "split_memcpy2_ms": k["split_memcpy2_p50_us"] / 1e3,
        }
        for mode in modes:
            z = by_mode[mode][size]
            row[f"{mode}_put_ms"] = z["put"]["median_ms"]
            row[f"{mode}_get_ms"] = z["get"]["median_ms"]
            row[f"{mode}_memcpy_ms"] = (z.get("memcpy") or {}).get("median_ms")
        rows.append(derive(row, modes))
    return rows


def _median_rows(rounds: list[list[dict]], modes) -> list[dict]:
    """Each time the median over the rounds, every ratio derived from those medians (so the
    quotient of the times beside it); the per-round ratios' least and most as ``KEY_range``."""
    out = []
    for per_size in zip(*rounds, strict=True):
        row = {
            "size": per_size[0]["size"],
            "rounds": len(per_size),
            "copy_threads": statistics.median_low([r["copy_threads"] for r in per_size]),
        }
        keys = list(TIMES) + [f"{m}_{op}_ms" for m in modes for op in ("put", "get")]
        for key in keys:
            row[key] = statistics.median([r[key] for r in per_size])
        for m in modes:  # a driver that timed no memcpy leaves it out
            vals = [r.get(f"{m}_memcpy_ms") for r in per_size]
            row[f"{m}_memcpy_ms"] = None if None in vals else statistics.median(vals)
        derive(row, modes)
        for key in row.copy():
            if key.startswith(("speedup_vs_", "time_vs_", "kvb_vs_")):
                vals = [r[key] for r in per_size]
                row[key + "_range"] = [min(vals), max(vals)]
        out.append(row)
    return out


def targets(rows: list[dict], modes) -> list[Target]:
    out = []
    for row in rows:
        if row["size"] == 32 * MiB:
            out.append(Target("32 MiB publish+claim vs memcpy", row["kvb_vs_memcpy"], 0.9))
            out.append(
                Target(
                    "32 MiB put+get vs multi-threaded memcpy, same threads",
                    row["kvb_vs_split_memcpy"],
                    0.8,
                    fmt="ratio",
                )
            )
            if "dummy" in modes:
                out.append(
                    Target(
                        "32 MiB publish+claim GB/s vs Mooncake dummy", row["speedup_vs_dummy"], 1.2
                    )
                )
        if row["size"] == 256 * KiB and "dummy" in modes:
            out.append(
                Target("256 KiB put+get time vs Mooncake dummy", row["time_vs_dummy"], 1 / 3, "<=")
            )
    return out


def run(
    socket_path: str,
    python: str | None,
    script: str | None = None,
    sizes=DEFAULT_SIZES,
    modes=DEFAULT_MODES,
    ops: int = 50,
    rounds: int = 1,
    peer_timeout: float = 180.0,
    lmcache_python: str | None = None,
    lmcache_script: str | None = None,
    kvcr_python: str | None = None,
    kvcr_script: str | None = None,
) -> Result:
    """``python`` None: Mooncake is not run (``modes`` ignored); ``lmcache_python`` None:
    LMCache is not run; ``kvcr_python`` None: KVCR is not run; none: kvbroker against memcpy
    only."""
    from .._client.engine import default_engine
    from . import transfer

    if python is None:
        modes = ()
    else:
        script = script or default_peer_script()
    modes = tuple(modes)
    # (column name, the driver's mode, its Python, its script, seconds it may take): LMCache's
    # server and worker start with torch, and on a loaded 2-core VM a 32 MiB store+retrieve of
    # a paged cache takes ~1 s, so it gets more time than Mooncake
    others = []
    if lmcache_python is not None:
        others.append(
            (
                "lmcache",
                LMCACHE_MODE,
                lmcache_python,
                lmcache_script or default_peer_script(LMCACHE_SCRIPT),
                max(peer_timeout, 900.0),
            )
        )
        lmcache_script = others[-1][3]
    if kvcr_python is not None:
        others.append(
            (
                "kvcr",
                KVCR_MODE,
                kvcr_python,
                kvcr_script or default_peer_script(KVCR_SCRIPT),
                max(peer_timeout, 300.0),
            )
        )
        kvcr_script = others[-1][3]
    all_modes = modes + tuple(name for name, *_ in others)
    rounds_rows, raw = [], []
    for _ in range(rounds):
        peer = run_peer(python, script, sizes, modes, ops, peer_timeout) if modes else []
        for name, mode, other_python, other_script, timeout in others:
            (got,) = run_peer(other_python, other_script, sizes, (mode,), ops, timeout)
            peer.append({**got, "mode": name, "driver_mode": got["mode"]})
        kvb = transfer.measure(socket_path, sizes, reps=ops, split_baseline=True)
        raw.append({"peer": peer, "kvbroker": kvb})
        rounds_rows.append(compare(peer, kvb, all_modes))
    rows = _median_rows(rounds_rows, all_modes)
    peer_versions = {
        r["mode"]: {
            "setup_s": r.get("setup_s"),
            "mooncake": r.get("mooncake"),
            "lmcache": r.get("lmcache"),
            "kvcr": r.get("kvcr"),
            "server": r.get("server"),
        }
        for r in raw[-1]["peer"]
    }
    notes = [
        "x memcpy same threads: two memcpys of the bytes, each split over that many "
        "threads as the copy engine splits it / kvbroker's put+get time."
    ]
    if all_modes:
        notes.append(
            "x PEER: the peer's put+get time / kvbroker's (above 1: kvbroker is "
            "faster); every ratio is the quotient of the two times beside it."
        )
    if lmcache_python:
        notes.append(
            "LMCache: one chunk of a paged float16 KV cache of the object's size "
            "(its unit of storage); its get is LOOKUP + prefetch wait + retrieve."
        )
    if kvcr_python:
        notes.append(
            "KVCR: its local DRAM tier in the engine's process (a library, not a "
            "daemon), deposit and deliver through NIXL (UCX); no per-key remove, its "
            "pool evicts."
        )
    if not all_modes:
        notes.append(
            "Mooncake not run (no --mooncake-python), LMCache not run (no "
            "--lmcache-python), KVCR not run (no --kvcr-python): kvbroker against "
            "memcpy only."
        )
    return Result(
        "peer",
        rows,
        columns(all_modes),
        params={
            "sizes": list(sizes),
            "modes": list(all_modes),
            "ops": ops,
            "rounds": rounds,
            "peer_script": os.path.abspath(script) if modes else None,
            "peer_python": python,
            "lmcache_script": os.path.abspath(lmcache_script) if lmcache_python else None,
            "lmcache_python": lmcache_python,
            "kvcr_script": os.path.abspath(kvcr_script) if kvcr_python else None,
            "kvcr_python": kvcr_python,
            "copy_engine_threads": default_engine().threads,
        },
        targets=targets(rows, all_modes),
        extra={"raw_rounds": raw, "peer_modes": peer_versions},
        notes=notes,
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    modes = result["params"]["modes"]
    labels = [
        f"{r['size'] >> 10} KiB" if r["size"] < MiB else f"{r['size'] >> 20} MiB" for r in rows
    ]
    series = [("kvbroker", "kvb_gbps")] + [(LABELS.get(m, m), f"{m}_gbps") for m in modes]
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
    ax.set_title("kvbroker and its peers, same session")
    ax.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "peer.png")]
