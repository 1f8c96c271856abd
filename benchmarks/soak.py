"""Soak: many clients publishing, claiming, matching prefixes and evicting under memory
pressure, on one daemon, for a while; then the books must balance exactly.

Each of ``--clients`` worker processes loops until the deadline over a mix of:

- ``put``: a P/D handoff object (2-3 buffers of 1 - 129 KiB, bytes derived from its key,
  checksummed), sometimes with 2 consumers;
- ``get``: claim another worker's recent key with ``verify=True`` (checksums recorded at seal)
  and compare every byte with the key's pattern; sometimes consuming it;
- ``prefix``: publish the blocks of one of a few shared prompts (two tenants, separated by
  ``cache_salt``) through :class:`kvbroker.prefix.PrefixCache`, then ``match`` a longer
  prompt and check every matched block's bytes;
- ``evict``: evict some of its own keys by regex.

The pool is small, so eviction runs all the time. An *error* is any exception other than the
expected outcomes of pressure and races (a key evicted or consumed before its claim:
``NotFound``; a key published twice: ``put`` returning False). Those outcomes did no work and
are not counted as operations (``ops``): a ``get`` counts only when it found its key and
checked its bytes, a ``put`` only when it published (``gets_found`` / ``gets_missed`` and
``expected_outcomes`` report both). A *mismatch* is a byte or checksum that differs. At the end: 0 errors, 0 mismatches, and the pools hold exactly the
extents of the objects left (no lease, no reservation, no quarantine), then nothing after
``evict --all``.

Usage: ``python benchmarks/soak.py [--clients 16] [--duration 600] [--pool-size 64M]
[--out benchmarks/results/soak-cpu.json]``; ``tests/test_soak.py`` runs a short one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kvbroker import ChecksumMismatch, Client, NotFound  # noqa: E402
from kvbroker._bench._common import measured_commit, run_conditions  # noqa: E402
from kvbroker._wire.objects import BUFFER_ALIGN
from kvbroker.prefix import PrefixCache  # noqa: E402

BLOCK = 16  # tokens per prefix block
PROMPTS = 6  # shared prompts per tenant: DP ranks hit each other's blocks


def pattern(key: str, n: int) -> np.ndarray:
    digest = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=32).digest(), np.uint8)
    return np.resize(digest, n)


def sizes_of(key: str) -> list[int]:
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    nbuf = 2 + h[0] % 2
    return [1024 + int.from_bytes(h[1 + 2 * i : 3 + 2 * i], "little") * 2 for i in range(nbuf)]


def prompt(tenant: int, p: int, n_tokens: int) -> list[int]:
    rng = random.Random(tenant * 1000 + p)
    return [rng.randrange(50_000) for _ in range(n_tokens)]


def block_bytes(cache: PrefixCache, key: str) -> dict[str, np.ndarray]:
    return {"k": pattern(key + "/k", 8192), "v": pattern(key + "/v", 8192)}


class Worker:
    def __init__(self, sock: str, wid: int, nclients: int, deadline: float) -> None:
        self.c = Client(sock, name=f"soak-{wid}", role="soak")
        self.wid, self.n, self.deadline = wid, nclients, deadline
        self.rng = random.Random(wid)
        self.ops: Counter = Counter()  # operations that did their work
        self.tried: Counter = Counter()  # every one started
        self.expected: Counter = Counter()  # benign outcomes of pressure and races
        self.errors: list[str] = []
        self.error_count = 0
        self.mismatches: list[str] = []
        self.bytes_in = self.bytes_out = self.bytes_got = 0  # bytes_got: by get alone
        self.seq = 0
        salt = ["tenant-a", "tenant-b"]
        self.caches = [
            PrefixCache(self.c, namespace="soak-prefix", block_size=BLOCK, cache_salt=s)
            for s in salt
        ]

    def run(self) -> None:
        kinds = ["put"] * 4 + ["get"] * 4 + ["prefix"] * 2 + ["evict"]
        while time.monotonic() < self.deadline:
            kind = self.rng.choice(kinds)
            self.tried[kind] += 1
            try:
                if getattr(self, "_" + kind)() is not False:  # False: found nothing to do
                    self.ops[kind] += 1
            except ChecksumMismatch as exc:
                self.mismatches.append(f"{kind}: {exc}")
            except Exception as exc:
                self.error_count += 1
                if len(self.errors) < 10:
                    self.errors.append(
                        f"{kind}: {type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=4)
                    )
        self.c.close()

    def _put(self) -> bool:
        key = f"w{self.wid}-{self.seq}"
        self.seq += 1
        sizes = sizes_of(key)
        bufs = {f"past_key.{i}": pattern(f"{key}/{i}", n) for i, n in enumerate(sizes)}
        if self.c.put(key, bufs, namespace="soak", consumers=self.rng.choice([1, 1, 2])):
            self.bytes_in += sum(sizes)
            return True
        self.expected["put_exists"] += 1
        return False

    def _get(self) -> bool:
        other = self.rng.randrange(self.n)
        # Workers run at about the same pace: another's recent keys are likely still there.
        key = f"w{other}-{max(0, self.seq - self.rng.randrange(1, 12))}"
        try:
            got = self.c.get(key, namespace="soak", verify=True, consume=self.rng.random() < 0.3)
        except NotFound:
            self.expected["get_not_found"] += 1
            return False
        sizes = sizes_of(key)
        for i, n in enumerate(sizes):
            if not np.array_equal(got[f"past_key.{i}"], pattern(f"{key}/{i}", n)):
                self.mismatches.append(f"get {key}: buffer {i} differs")
        self.bytes_out += sum(sizes)
        self.bytes_got += sum(sizes)
        return True

    def _prefix(self) -> None:
        cache = self.rng.choice(self.caches)
        tenant = self.caches.index(cache)
        p = self.rng.randrange(PROMPTS)
        tokens = prompt(tenant, p, BLOCK * self.rng.randrange(1, 12))
        keys = cache.hashes(tokens)
        self.bytes_in += 16384 * cache.publish(
            tokens, lambda i: block_bytes(cache, keys[i]), block_sizes={"k": 8192, "v": 8192}
        )
        longer = prompt(tenant, p, BLOCK * 12 + 1)
        all_keys = cache.hashes(longer)
        with cache.match(longer, hashes=all_keys) as m:
            for i, blk in enumerate(m.blocks):
                want = block_bytes(cache, all_keys[i])
                for name in ("k", "v"):
                    if not np.array_equal(blk[name], want[name]):
                        self.mismatches.append(f"prefix block {i} {name} differs")
            self.bytes_out += 16384 * m.num_blocks
            self.ops["prefix_blocks_matched"] += m.num_blocks

    def _evict(self) -> None:
        lo = max(0, self.seq - 50)
        r = self.c.evict(match=f"^w{self.wid}-{lo}\\d*$", namespace="soak")
        self.ops["evicted_by_request"] += r.count


def _work(sock: str, wid: int, nclients: int, deadline: float, out) -> None:
    try:
        w = Worker(sock, wid, nclients, deadline)
        w.run()
        out.put(
            {
                "wid": wid,
                "ops": dict(w.ops),
                "tried": dict(w.tried),
                "expected": dict(w.expected),
                "errors": w.errors,
                "error_count": w.error_count,
                "mismatches": w.mismatches,
                "bytes_in": w.bytes_in,
                "bytes_out": w.bytes_out,
                "bytes_got": w.bytes_got,
            }
        )
    except BaseException as exc:  # a worker that cannot even start is an error too
        out.put(
            {
                "wid": wid,
                "ops": {},
                "tried": {},
                "expected": {},
                "error_count": 1,
                "mismatches": [],
                "errors": [f"worker: {type(exc).__name__}: {exc}"],
                "bytes_in": 0,
                "bytes_out": 0,
                "bytes_got": 0,
            }
        )


def extent_bytes(sizes: list[int], page: int) -> int:
    span = sum(-(-n // BUFFER_ALIGN) * BUFFER_ALIGN for n in sizes)
    return -(-max(span, 1) // page) * page


def audit(sock: str) -> dict:
    """The books after the run: exact pool accounting, then an empty pool after evict all."""
    with Client(sock, name="soak-audit") as c:
        deadline = time.monotonic() + 30
        while len(c.stat().clients) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = c.stat()
        page = st.pools[0].page_size
        objs = c.list(limit=100_000)
        want = 0
        for o in objs:
            with c.claim(o.key, namespace=o.namespace, verify=True) as lease:
                want += extent_bytes([e[2] for e in lease.extents().values()], page)
        st = c.stat()
        pools = st.pools[0]
        result = {
            "objects_left": len(objs),
            "used_bytes": st.used,
            "objects_extent_bytes": want,
            "leased_write_bytes": pools.leased_write,
            "leased_read_bytes": pools.leased_read,
            "quarantined_bytes": pools.quarantined,
            "daemon_counters": {
                k: getattr(st.counters, k)
                for k in (
                    "publishes",
                    "claims",
                    "evictions",
                    "evicted_bytes",
                    "hits",
                    "misses",
                    "prefix_queries",
                    "prefix_hit_blocks",
                    "expired_leases",
                )
            },
        }
        c.evict(all=True)
        result["used_after_evict_all"] = c.stat().used
        result["exact"] = (
            st.used == want
            and pools.leased_write == 0
            and pools.quarantined == 0
            and pools.leased_read == 0
            and result["used_after_evict_all"] == 0
        )
    return result


def run(
    clients: int = 16,
    duration: float = 600.0,
    pool_size: str = "64M",
    socket_path: str | None = None,
) -> dict:
    from conftest import DaemonProcess

    sock = socket_path or os.path.join(tempfile.mkdtemp(prefix="kvbsoak"), "kvb.sock")
    daemon = DaemonProcess(sock, "--pool-size", pool_size, "--page-size", "4K")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    before = run_conditions()
    t0 = time.monotonic()
    deadline = t0 + duration
    procs = [
        ctx.Process(target=_work, args=(sock, w, clients, deadline, out)) for w in range(clients)
    ]
    for p in procs:
        p.start()
    reports = []
    try:
        for _ in procs:
            reports.append(out.get(timeout=duration + 120))
        for p in procs:
            p.join(30)
        elapsed = time.monotonic() - t0
        books = audit(sock)
        alive = daemon.proc.poll() is None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        rc = daemon.stop()
    ops: Counter = Counter()
    tried: Counter = Counter()
    expected: Counter = Counter()
    for r in reports:
        ops.update(r["ops"])
        tried.update(r["tried"])
        expected.update(r["expected"])
    main_ops = sum(ops[k] for k in ("put", "get", "prefix", "evict"))
    return {
        "benchmark": "soak: publish / claim / prefix match / evict under memory pressure",
        "commit": measured_commit(),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "conditions_before": before,
        "conditions_after": run_conditions(),
        "clients": clients,
        "duration_s": round(elapsed, 1),
        "pool_size": pool_size,
        "ops": main_ops,  # operations that did their work (a get that found its key, ...)
        "ops_per_s": round(main_ops / elapsed, 1),
        "ops_by_kind": dict(ops),
        "gets_found": ops["get"],
        "gets_missed": expected["get_not_found"],
        "tried_by_kind": dict(tried),
        "expected_outcomes": dict(expected),
        "errors": sum(r["error_count"] for r in reports),
        "error_samples": [e for r in reports for e in r["errors"]][:10],
        "mismatches": sum(len(r["mismatches"]) for r in reports),
        "mismatch_samples": [m for r in reports for m in r["mismatches"]][:10],
        "bytes_published": sum(r["bytes_in"] for r in reports),
        "bytes_claimed": sum(r["bytes_out"] for r in reports),
        "bytes_got": sum(r["bytes_got"] for r in reports),
        "daemon_alive_at_end": alive,
        "daemon_exit_status": rc,
        "accounting": books,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds")
    ap.add_argument("--pool-size", default="64M")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "soak-cpu.json")
    )
    args = ap.parse_args()
    res = run(args.clients, args.duration, args.pool_size)
    acc = res["accounting"]
    print(
        f"{res['clients']} clients, {res['duration_s']} s: {res['ops']} ops "
        f"({res['ops_per_s']}/s) {res['ops_by_kind']}; gets that found their key "
        f"{res['gets_found']}, that found nothing {res['gets_missed']} (not counted)"
    )
    print(
        f"errors {res['errors']}, mismatches {res['mismatches']}, "
        f"published {res['bytes_published']} B, claimed {res['bytes_claimed']} B, "
        f"evictions {acc['daemon_counters']['evictions']}"
    )
    print(
        f"accounting exact: {acc['exact']} (used {acc['used_bytes']} B = objects "
        f"{acc['objects_extent_bytes']} B; after evict all {acc['used_after_evict_all']} B)"
    )
    for sample in res["error_samples"] + res["mismatch_samples"]:
        print("  ", sample)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    ok = (
        res["errors"] == 0
        and res["mismatches"] == 0
        and acc["exact"]
        and res["daemon_alive_at_end"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
