"""The disk tier ([tier.disk]) against a DRAM-only daemon and against recomputing.

A working set of ``--factor`` (4) times the pool, objects of ``--object-size`` bytes, is
published once, then claimed (``get``: claim, copy out, release) in two orders: cycling
through it in order, and uniformly at random. A claim that finds nothing is a miss, served
by "recomputing" the object and publishing it again; the three ways to serve the same
requests:

- **disk tier**: a daemon with the pool and ``[tier.disk]`` on ``--dir``;
- **DRAM only**: a daemon with the same pool and no disk tier;
- **recompute**: every request recomputed.

Recompute time is modeled, not slept: an object of B bytes is the KV cache of
B / kv_bytes_per_token tokens, recomputed at a prefill rate measured on an H100 for an 8B
Llama (``benchmarks/results/ttft-cuda-8b-h100-run1.json``: 16,384 tokens, 2 GiB of KV,
prefill 592 ms median, i.e. 27.7k tokens/s and 128 KiB of KV per token). A miss's latency
is the failed claim, plus that time, plus the put that publishes the object again.

Promotion throughput: every object moved to disk (``evict --tier dram``), the page cache
dropped (as root), then ``--threads`` clients claim disjoint shares of them at once, so the
daemon promotes (read, verify, seal) the whole working set; compared with ``dd
iflag=direct`` reading the tier's own slot file sequentially (the same file system, the
same bytes, after the same drop), in blocks of 4 MiB and of one object.

    .venv/bin/python benchmarks/bench_disk_tier.py --dir /var/tmp [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvbroker._bench._common import machine_info, measured_commit, run_conditions  # noqa: E402
from latency_stats import percentile  # benchmarks/latency_stats.py, beside this file

TTFT = os.path.join(ROOT, "benchmarks", "results", "ttft-cuda-8b-h100-run1.json")


def recompute_model() -> dict:
    with open(TTFT) as f:
        d = json.load(f)
    tokens, kv = d["prompt_tokens"], d["kv_bytes"]
    prefill_s = d["median"]["recompute_prefill_s"]
    return {
        "source": os.path.relpath(TTFT, ROOT),
        "tokens": tokens,
        "kv_bytes": kv,
        "prefill_s": prefill_s,
        "tokens_per_s": tokens / prefill_s,
        "kv_bytes_per_token": kv / tokens,
        "seconds_per_byte": prefill_s / kv,
    }


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_claims(c, payloads: dict, order: list[str], model_s: float) -> dict:
    import numpy as np

    from kvbroker import NotFound

    lat, hits, wrong = [], 0, 0
    for key in order:
        t0 = time.perf_counter()
        try:
            got = c.get(key)
        except NotFound:
            missed = time.perf_counter() - t0
            t1 = time.perf_counter()
            c.put(key, {"past_key.0": payloads[key]}, replace=True)
            lat.append(missed + model_s + time.perf_counter() - t1)
            continue
        lat.append(time.perf_counter() - t0)
        hits += 1
        if not np.array_equal(got["past_key.0"], payloads[key]):
            wrong += 1
    return {
        "claims": len(order),
        "hits": hits,
        "hit_rate": hits / len(order),
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
        "wrong_bytes": wrong,
    }


def dd_read(path: str, nbytes: int, bs: int) -> float | None:
    drop_caches()
    proc = subprocess.run(
        [
            "dd",
            f"if={path}",
            "of=/dev/null",
            f"bs={bs}",
            f"count={max(1, nbytes // bs)}",
            "iflag=direct",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return max(1, nbytes // bs) * bs / float(m.group(1)) / 1e9 if m else None


def promotion_throughput(d, keys: list[str], obj: int, threads: int) -> dict:
    with d.client() as c:
        c.evict(match=".", tier="dram")  # everything to disk
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = c.stat().disk
            if not st.writing_bytes and not st.index_pending:
                break
            time.sleep(0.05)
        before = c.stat().disk
        assert before.only_on_disk == len(keys), before
    dropped = drop_caches()
    shares = [keys[i::threads] for i in range(threads)]
    clients = [d.client() for _ in range(threads)]
    errors: list[BaseException] = []

    def claim_all(c, share):
        try:
            for k in share:
                with c.claim(k):
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [
        threading.Thread(target=claim_all, args=(c, s))
        for c, s in zip(clients, shares, strict=True)
    ]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    with d.client() as c:
        after = c.stat().disk
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    promoted = after.promoted - before.promoted
    return {
        "objects": len(keys),
        "bytes": len(keys) * obj,
        "seconds": wall,
        "gbps": len(keys) * obj / wall / 1e9,
        "promoted": promoted,
        "promote_seconds_sum": after.promote_seconds - before.promote_seconds,
        "caches_dropped": dropped,
        "threads": threads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the disk tier's directory goes")
    ap.add_argument("--pool-size", default="64M")
    ap.add_argument("--object-size", type=int, default=1 << 20)
    ap.add_argument("--factor", type=int, default=4, help="working set / pool")
    ap.add_argument("--passes", type=int, default=2, help="cycles through the working set")
    ap.add_argument("--threads", type=int, default=4, help="clients promoting at once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import numpy as np

    from kvbroker._server.config_values import size as parse_size
    from kvbroker._server.disk_store import SLOTS_NAME
    from kvbroker.testing import running_daemon

    before = run_conditions()
    pool = parse_size(args.pool_size)
    obj = args.object_size
    n = args.factor * pool // obj
    keys = [f"obj{i:05d}" for i in range(n)]
    payloads = {
        k: np.random.default_rng(i).integers(0, 256, obj, dtype=np.uint8)
        for i, k in enumerate(keys)
    }
    model = recompute_model()
    model_s = obj * model["seconds_per_byte"]
    rng = random.Random(args.seed)
    orders = {
        "cycle": keys * args.passes,
        "random": [rng.choice(keys) for _ in range(n * args.passes)],
    }
    workdir = tempfile.mkdtemp(prefix="kvb-disk-bench-", dir=args.dir)
    disk_dir = os.path.join(workdir, "tier")
    disk_size = 2 * n * obj
    out: dict = {
        "scenario": "disk-tier",
        "commit": measured_commit(),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "pool_size": pool,
        "object_size": obj,
        "objects": n,
        "working_set": n * obj,
        "disk_dir": args.dir,
        "disk_size": disk_size,
        "recompute_model": model,
        "recompute_s_per_object": model_s,
        "conditions_before": before,
        "runs": {},
    }
    try:
        for label, env in (
            (
                "disk",
                {
                    "KVBROKER_TIER_DISK_DIRECTORIES": disk_dir,
                    "KVBROKER_TIER_DISK_SIZE": str(disk_size),
                },
            ),
            ("dram", {}),
        ):
            with running_daemon(pool_size=args.pool_size, page_size="64K", env=env) as d:
                with d.client() as c:
                    for k in keys:  # published once, in order
                        c.put(k, {"past_key.0": payloads[k]}, replace=True)
                    runs = {
                        name: run_claims(c, payloads, order, model_s)
                        for name, order in orders.items()
                    }
                    st = c.stat()
                    runs["stat"] = {
                        "evictions": st.counters.evictions,
                        "disk": None
                        if st.disk is None
                        else {
                            k: getattr(st.disk, k)
                            for k in (
                                "objects",
                                "only_on_disk",
                                "promoted",
                                "demoted",
                                "written_back",
                                "skipped",
                                "o_direct",
                                "errors",
                                "dropped_damaged",
                            )
                        },
                    }
                if label == "disk":
                    runs["promotion"] = promotion_throughput(d, keys, obj, args.threads)
                    slots = os.path.join(disk_dir, SLOTS_NAME)
                    runs["dd_gbps"] = {
                        f"{bs >> 20}MiB": dd_read(slots, n * obj, bs) for bs in (4 << 20, obj)
                    }
            out["runs"][label] = runs
    finally:
        subprocess.run(["rm", "-rf", workdir], check=False)
    lat = model_s * 1e3
    out["runs"]["recompute"] = {
        name: {
            "claims": len(order),
            "hits": 0,
            "hit_rate": 0.0,
            "p50_ms": lat,
            "p99_ms": lat,
            "mean_ms": lat,
        }
        for name, order in orders.items()
    }
    promo = out["runs"]["disk"]["promotion"]
    dd = out["runs"]["disk"]["dd_gbps"]
    raw = max(v for v in dd.values() if v) if any(dd.values()) else None
    out["promotion_vs_dd"] = promo["gbps"] / raw if raw else None
    out["conditions_after"] = run_conditions()
    for name in orders:
        for label in ("disk", "dram", "recompute"):
            r = out["runs"][label][name]
            print(
                f"{name:7s} {label:10s} hit rate {r['hit_rate']:.2f}  p50 {r['p50_ms']:.2f} ms"
                f"  p99 {r['p99_ms']:.2f} ms"
            )
    print(
        f"promotion {promo['gbps']:.2f} GB/s ({promo['threads']} clients); dd iflag=direct "
        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in dd.items() if v)
        + (f"; promotion / dd {out['promotion_vs_dd']:.2f}" if raw else "")
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
