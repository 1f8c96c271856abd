"""Benchmarks users can rerun against their own daemon and hardware (``kvbroker bench``).

Every scenario measures its own baseline in the same run (memcpy for transfers), so the
figures that matter are ratios: these machines are shared and noisy.

Transfer accounting: ``put`` copies the source once into the pool; ``get`` copies the pool
once into the destination. "publish+claim GB/s" counts both copies (2 × size bytes moved over
the put+get time) and is compared with memcpy GB/s of the same size; publish-only and
claim-only rates are given too.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["machine_info", "spawned_daemon", "transfer", "rpc", "print_table"]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KiB, 64 * KiB, 256 * KiB, 4 * MiB, 32 * MiB, 256 * MiB)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    import msgpack
    import numpy

    from ._version import __version__

    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "kvbroker": __version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


@contextlib.contextmanager
def spawned_daemon(pool_size: str = "1G", *extra: str) -> Iterator[str]:
    """A private daemon for the benchmark; yields its socket path."""
    from . import BrokerUnavailable, Client

    d = tempfile.mkdtemp(prefix="kvb-bench-")
    path = os.path.join(d, "kvb.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbroker", "serve", "--socket", path, "--pool-size", pool_size,
         "--log-level", "warning", *extra],
    )  # fmt: skip
    try:
        for _ in range(500):
            try:
                Client(path, map_pools=False).close()
                break
            except BrokerUnavailable:
                if proc.poll() is not None:
                    raise RuntimeError("the benchmark daemon failed to start") from None
                time.sleep(0.02)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)


def _median_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def transfer(socket_path: str, sizes=DEFAULT_SIZES, budget_bytes: int = 2 << 30) -> list[dict]:
    """Publish+claim of one buffer per object, sizes 4 KiB .. 256 MiB, memcpy alongside."""
    import numpy as np

    from . import Client

    rows = []
    with Client(socket_path, name="bench", role="bench") as c:
        for size in sizes:
            reps = int(max(20, min(2000, budget_bytes // (4 * size))))
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            dst = np.empty_like(src)
            dst.fill(0)  # fault the destination in before timing
            np.copyto(dst, src)
            memcpy, put_t, get_t, rt = [], [], [], []
            # memcpy and put+get alternate, so a noisy neighbour hits both alike.
            for i in range(reps + 3):
                key = f"bench-{size}-{i}"
                tm = time.perf_counter()
                np.copyto(dst, src)
                t0 = time.perf_counter()
                c.put(key, {"kv": src})
                t1 = time.perf_counter()
                c.get(key, {"kv": dst}, consume=True)
                t2 = time.perf_counter()
                if i >= 3:  # warm-up
                    memcpy.append(t0 - tm)
                    put_t.append(t1 - t0)
                    get_t.append(t2 - t1)
                    rt.append(t2 - t0)
            if not np.array_equal(dst, src):
                raise AssertionError(f"bytes differ at size {size}")
            m, p, g, r = (statistics.median(x) for x in (memcpy, put_t, get_t, rt))
            rows.append({
                "size": size, "reps": reps,
                "memcpy_gbps": size / m / 1e9,
                "publish_gbps": size / p / 1e9,
                "claim_gbps": size / g / 1e9,
                "publish_claim_gbps": 2 * size / r / 1e9,
                "ratio_vs_memcpy": (2 * m) / r,
                "roundtrip_p50_us": r * 1e6,
                "roundtrip_p99_us": _pct(rt, 0.99) * 1e6,
                "put_p50_us": p * 1e6,
                "get_p50_us": g * 1e6,
            })  # fmt: skip
    return rows


def _rpc_process(socket_path: str, seconds: float) -> list[float]:
    from . import Client

    lat = []
    with Client(socket_path, map_pools=False) as c:
        c.put("rpc-probe", {"x": b"1"})
        end = time.perf_counter() + seconds
        while (t := time.perf_counter()) < end:
            c.exists("rpc-probe")
            lat.append(time.perf_counter() - t)
    return lat


def rpc(socket_path: str, clients=(1, 4, 16), seconds: float = 2.0) -> list[dict]:
    """Control-plane ops/s (``exists`` round trips) with N concurrent client processes."""
    import multiprocessing as mp

    rows = []
    ctx = mp.get_context("spawn")
    for n in clients:
        with ctx.Pool(n) as pool:
            results = pool.starmap(_rpc_process, [(socket_path, seconds)] * n)
        lat = [x for r in results for x in r]
        rows.append({
            "clients": n,
            "ops_per_s": len(lat) / seconds,
            "p50_us": _pct(lat, 0.5) * 1e6,
            "p99_us": _pct(lat, 0.99) * 1e6,
        })  # fmt: skip
    return rows


def prefix(socket_path: str, tokens: int = 8192, block: int = 16, reps: int = 200,
           layers: int = 2, block_bytes: int = 16 * 1024) -> list[dict]:
    """match_prefix latency for ``tokens`` tokens in ``block``-token blocks, against a plain
    put+claim round trip of one small object measured in the same run; and the GB/s of
    loading a matched prefix (copying every block once into the engine's buffer)."""
    import numpy as np

    from . import Client
    from .prefix import PrefixCache

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 32000, tokens + 1).tolist()
    nblocks = tokens // block
    data = rng.integers(0, 256, (nblocks, layers, block_bytes), dtype=np.uint8)
    sink = np.empty_like(data)
    with Client(socket_path, name="bench-prefix") as c:
        pc = PrefixCache(c, namespace="bench-prefix", block_size=block)
        t = time.perf_counter()
        pc.publish(toks, [{f"past_key.{l}": data[b, l] for l in range(layers)}
                          for b in range(nblocks)])  # fmt: skip
        publish_s = time.perf_counter() - t
        small = b"x" * 4096
        # An engine hashes a prompt once, when the request arrives; timed on its own here.
        hash_t = _median_time(lambda: pc.hashes(toks[: nblocks * block]), 20)
        hs = pc.hashes(toks[: nblocks * block])
        base, match_t, load_t = [], [], []
        for i in range(reps):
            t0 = time.perf_counter()
            c.put(f"rt-{i}", {"x": small})
            with c.claim(f"rt-{i}", consume=True):
                pass
            t1 = time.perf_counter()
            with pc.match(toks, hashes=hs) as m:
                t2 = time.perf_counter()
                for b, blk in enumerate(m.blocks):
                    for l in range(layers):
                        np.copyto(sink[b, l], blk[f"past_key.{l}"])
                t3 = time.perf_counter()
            assert m.num_blocks == nblocks
            base.append(t1 - t0)
            match_t.append(t2 - t1)
            load_t.append(t3 - t2)
        assert np.array_equal(sink, data)
        c.evict(namespace="bench-prefix")
    mb, mm, ml = (statistics.median(x) for x in (base, match_t, load_t))
    return [{
        "tokens": tokens, "blocks": nblocks, "block_tokens": block,
        "prefix_bytes": int(data.nbytes),
        "put_claim_p50_us": mb * 1e6,
        "match_p50_us": mm * 1e6,
        "match_p99_us": _pct(match_t, 0.99) * 1e6,
        "match_vs_put_claim": mm / mb,
        "hash_p50_us": statistics.median(hash_t) * 1e6,
        "load_gbps": data.nbytes / ml / 1e9,
        "publish_ms": publish_s * 1e3,
    }]  # fmt: skip


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format) triples."""
    head = "  ".join(f"{h:>{max(len(h), 10)}}" for _, h, _ in columns)
    lines = [head]
    for row in rows:
        cells = []
        for key, h, fmt in columns:
            v = row[key]
            cells.append(f"{(_human(v) if fmt == 'size' else format(v, fmt)):>{max(len(h), 10)}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n} B"


def dump(path: str, scenario: str, rows: list[dict], **extra: Any) -> None:
    with open(path, "w") as f:
        json.dump({"scenario": scenario, "machine": machine_info(), "rows": rows, **extra}, f,
                  indent=2)  # fmt: skip
