#!/usr/bin/env python3
"""KVCR's side of ``kvbroker bench peer``: its local DRAM tier's put+get in kvbroker's pattern.

Run it with a Python that has the ``kvcr`` wheel (0.1.1) and NIXL (docs/operating.md,
"Comparing with LMCache", says how it goes in on a CPU host). ``kvbroker bench peer
--kvcr-python PYTHON`` runs it beside the other peers' drivers and kvbroker's ``transfer``
scenario on the same sizes and compares the medians.

KVCR (NVIDIA's KV Cache Runner) is a library an engine embeds, not a daemon: its local tier
is host memory the engine hands it (``LocalDramOptions``), filled and read through NIXL (UCX
on a CPU host) by KVCR's own progress thread. Per size, this driver starts one ``KVCR`` with a
framework region of two elements (the engine's source and destination buffers) and a local
DRAM pool of ``--pool-objects`` objects, and runs kvbroker's ``transfer`` loop: 3 untimed
warm-up round trips, then ``--ops`` times: a memcpy of the source (timed on its own, as
kvbroker does), ``deposit`` of the source element under a new key (the put: KVCR copies it
into its pool), ``deliver`` of that key into the destination element (the get), each timed to
its completion (``poll_completed``), the destination compared with the source. KVCR has no
per-key remove: older keys leave the pool by its own eviction as new ones arrive (untimed,
inside the next deposit). Every round trip's bytes differ (a stamp), so a get that returned
another object's bytes, or nothing, is caught.

Output (``--json-out``): the shape ``kvbroker/_bench/peer.py`` reads from every peer driver,
one entry ``{"mode": "local_dram", "setup_s", "kvcr", "sizes": [{"size", "put": STATS, "get":
STATS, "memcpy": STATS, "data_ok", "errors"}]}``; a failed run is ``{"mode", "error"}`` and
exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by file path
from latency_stats import stats  # benchmarks/latency_stats.py, beside this file

KiB, MiB = 1 << 10, 1 << 20
MODE = "local_dram"
WARMUP = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvcr_version():
    with contextlib.suppress(Exception):
        from importlib import metadata

        return metadata.version("kvcr")
    return None


def wait(kvcr, handle: int, timeout: float = 30.0) -> dict:
    """The results of operation ``handle``, polled as an engine's step would."""
    end = time.monotonic() + timeout
    while True:
        for done, results in kvcr.poll_completed():
            if done == handle:
                return results
        if time.monotonic() > end:
            raise TimeoutError(f"KVCR operation {handle} did not complete in {timeout:.0f} s")
        time.sleep(0)  # the progress thread needs the GIL


def measure_size(size: int, ops: int, pool_objects: int, deadline: float) -> dict:
    import numpy as np
    from kvcr import KVCR, KVCRBindings
    from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
    from kvcr.types import BlockKey, MemoryRef, RegionDescriptor

    name = f"kvb-peer-kvcr-{os.getpid()}-{size}"
    engine = np.zeros(2 * size, dtype=np.uint8)  # element 0: the source, 1: the destination
    src, dst = engine[:size], engine[size:]
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    pool = np.zeros(pool_objects * size, dtype=np.uint8)
    pool[::4096] = 0  # touched once, as kvbroker's pools are prefaulted
    scratch = np.empty_like(src)
    # no framework pinning in this loop: the engine's buffers are KVCR's sources directly
    bindings = KVCRBindings(
        request_pin=lambda keys: 0, poll_pin_results=lambda: (), release_pin=lambda handle: True
    )
    config = KVCRConfig(
        nixl_agent_name=name,
        pool_layouts=[("kv", size)],
        nixl_listen_port=free_port(),
        operation_timeout_ms=30_000,
        abandon_timeout_ms=60_000,
    )
    backends = KVCRBackendConfigs(
        framework_regions=[
            RegionDescriptor(addr=engine.ctypes.data, stride=size, count=2, size=size, label="kv")
        ],
        local_dram=LocalDramOptions(pools=[("kv", pool.ctypes.data, pool.nbytes)]),
    )
    kvcr = KVCR(config, bindings, backends)
    cp, put, get, errors = [], [], [], []
    data_ok = True
    try:
        for i in range(WARMUP + ops):
            if time.time() > deadline:
                errors.append(f"time budget spent after {max(0, i - WARMUP)} timed round trips")
                break
            stamp = np.frombuffer(((size << 20) + i).to_bytes(8, "little"), dtype=np.uint8)
            src[:8], src[-8:] = stamp, stamp
            dst[:8], dst[-8:] = 0xFF, 0xFF
            key = BlockKey(f"peer-{size}-{i}".encode())
            t0 = time.perf_counter()
            np.copyto(scratch, src)
            t1 = time.perf_counter()
            ref = [MemoryRef(end_point_name=name, label="kv", element_index=0)]
            got = wait(kvcr, kvcr.deposit({key: ref}))
            t2 = time.perf_counter()
            if not got.get(key) or not got[key].success:
                errors.append(f"deposit {i}: {got.get(key)}")
                break
            ref = [MemoryRef(end_point_name=name, label="kv", element_index=1)]
            got = wait(kvcr, kvcr.deliver({key: ref}))
            t3 = time.perf_counter()
            if not got.get(key) or not got[key].success:
                errors.append(f"deliver {i}: {got.get(key)}")
                break
            if not np.array_equal(src, dst):
                data_ok = False
                errors.append(f"deliver {i}: bytes differ from what was deposited")
            if i >= WARMUP:
                cp.append(t1 - t0)
                put.append(t2 - t1)
                get.append(t3 - t2)
    finally:
        kvcr.close()
    return {
        "size": size,
        "put": stats(put, size),
        "get": stats(get, size),
        "memcpy": stats(cp, size),
        "data_ok": data_ok,
        "errors": errors[:5],
        "pool_objects": pool_objects,
    }


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("K", KiB), ("M", MiB)):
        if text.endswith(suffix):
            return int(text[:-1]) * mult
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="262144,4194304,33554432")
    ap.add_argument("--ops", type=int, default=50)
    ap.add_argument("--modes", default=MODE, help=f"only {MODE} (KVCR's local tier)")
    ap.add_argument("--pool-objects", type=int, default=8)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds for all sizes")
    ap.add_argument("--workdir", help="unused (the peer protocol passes it)")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    if a.modes != MODE:
        result = {"mode": a.modes, "error": f"only the {MODE} mode is driven"}
    else:
        t0 = time.perf_counter()
        deadline = time.time() + a.budget
        try:
            out = [measure_size(s, a.ops, a.pool_objects, deadline) for s in sizes]
            result = {
                "mode": MODE,
                "setup_s": None,
                "kvcr": kvcr_version(),
                "sizes": out,
                "seconds": time.perf_counter() - t0,
            }
        except Exception as exc:  # noqa: BLE001  (reported in the JSON, as the contract says)
            result = {"mode": MODE, "error": f"{type(exc).__name__}: {exc}"}
    failed = "error" in result or any(z["errors"] for z in result["sizes"])
    text = json.dumps([result], indent=1)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text + "\n")
    print(text if failed else json.dumps({"mode": result["mode"], "ok": True}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
