"""A/B of the remote pull in one run: two pairs of daemons, one running the code of
``--base`` (a source tree, e.g. ``git archive COMMIT | tar -x -C DIR``, with the compiled
modules copied in), one this tree's, and the standalone raw NIXL READ of bench_remote.py,
alternated round by round on the same objects, so load spikes of a shared VM fall on both.

Each round: a remote claim from each pair (the order alternating) and one raw READ; per
size, the median of the per-round ratios (new / base claim; raw READ / claim of each).

    UCX_TLS=tcp .venv/bin/python benchmarks/experiments/ab_remote_pull.py --base /tmp/base \
        [--sizes 32MiB 1GiB] [--rounds 7] [--big-rounds 3] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402
from bench_remote import SIZES, Pair, RawReader  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import checkout_commit, machine_info, run_conditions  # noqa: E402


def _pair(folder: str, pool: str, src: str | None) -> Pair:
    if not src:
        return Pair(folder, pool, pool)
    # The daemons import kvbroker from that tree: ``python -m`` puts its working directory
    # first on sys.path (before PYTHONPATH), so they start there.
    old, here = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = src
    os.chdir(src)
    try:
        return Pair(folder, pool, pool)
    finally:
        os.chdir(here)
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _claim(pair: Pair, cb: Client, name: str, src: np.ndarray) -> tuple[float, dict, bool]:
    cb.evict(name)
    t0 = time.perf_counter()
    with cb.claim(name, peer=pair.address, ttl=900) as lease:
        dt = time.perf_counter() - t0
        ok = np.array_equal(lease["kv"], src)
    tr = cb.stat().transfer
    phases = dict(getattr(tr, "last_pull_phases", None) or {})
    phases["read_in_pull"] = tr.last_read_seconds
    phases["client"] = dt - tr.last_pull_seconds
    return dt, phases, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="source tree of the code before")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--big-rounds", type=int, default=3, help="rounds of 1 GiB and more")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    before = run_conditions()
    sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
    pool = f"{(max(sizes.values()) + (256 << 20)) >> 20}M"
    folder = tempfile.mkdtemp(prefix="kvb-ab-remote-")
    pairs = {
        "base": _pair(os.path.join(folder, "base"), pool, os.path.abspath(args.base)),
        "new": _pair(os.path.join(folder, "new"), pool, None),
    }
    raw = RawReader(folder, sizes)
    rows = []
    try:
        clients = {v: (Client(p.sock_a), Client(p.sock_b)) for v, p in pairs.items()}
        for name, n in sizes.items():
            src = np.random.default_rng(n % 9973).integers(0, 256, n, dtype=np.uint8)
            for ca, _ in clients.values():
                ca.put(name, {"kv": src})
            rounds = args.big_rounds if n >= 1 << 30 else args.rounds
            samples: dict = {"base": [], "new": [], "raw": [], "exact": []}
            for i in range(rounds + 1):  # round 0 connects the peers: not counted
                order = ("base", "new") if i % 2 == 0 else ("new", "base")
                got = {}
                for v in order:
                    got[v] = _claim(pairs[v], clients[v][1], name, src)
                r = raw.read(name)
                if i == 0:
                    continue
                for v in ("base", "new"):
                    samples[v].append({"claim_s": got[v][0], **got[v][1]})
                samples["raw"].append(r)
                samples["exact"].append(got["base"][2] and got["new"][2])
            med = statistics.median
            ratio = med(
                s["claim_s"] / b["claim_s"]
                for s, b in zip(samples["new"], samples["base"], strict=True)
            )
            row = {
                "size": name,
                "nbytes": n,
                "rounds": rounds,
                "samples": samples,
                "bit_exact": all(samples["exact"]) and raw.exact(name),
                "new_over_base_claim_p50": ratio,
                "raw_read_p50_s": med(samples["raw"]),
            }
            for v in ("base", "new"):
                rs = [r / s["claim_s"] for r, s in zip(samples["raw"], samples[v], strict=True)]
                keys = samples[v][0].keys()
                row[v] = {
                    "claim_p50_s": med(s["claim_s"] for s in samples[v]),
                    "raw_over_claim_p50": med(rs),
                    "raw_over_claim_min": min(rs),
                    "raw_over_claim_max": max(rs),
                    "phases_p50_s": {
                        k: med(s.get(k, 0.0) for s in samples[v]) for k in keys if k != "claim_s"
                    },
                }
            rows.append(row)
            print(
                f"{name}: claim p50 base {row['base']['claim_p50_s'] * 1e3:.1f} ms, new "
                f"{row['new']['claim_p50_s'] * 1e3:.1f} ms (new/base {ratio:.2f}); raw READ "
                f"p50 {row['raw_read_p50_s'] * 1e3:.1f} ms; raw/claim base "
                f"{row['base']['raw_over_claim_p50']:.2f}, new "
                f"{row['new']['raw_over_claim_p50']:.2f}",
                flush=True,
            )
            for v in ("base", "new"):
                print(
                    f"  {v} phases p50 (ms): "
                    + ", ".join(f"{k} {x * 1e3:.2f}" for k, x in row[v]["phases_p50_s"].items()),
                    flush=True,
                )
            for ca, cb in clients.values():
                cb.evict(name)
                ca.evict(name)
            del src
        for ca, cb in clients.values():
            ca.close()
            cb.close()
    finally:
        raw.close()
        for p in pairs.values():
            p.close()
    out = {
        "what": "remote pull A/B (base tree vs this tree), the raw NIXL READ beside",
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "commit": checkout_commit(ROOT),
        "base": args.base,
        "machine": machine_info(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "conditions": {"before": before, "after": run_conditions()},
        "rows": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
