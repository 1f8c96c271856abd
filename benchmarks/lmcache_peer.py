#!/usr/bin/env python3
"""LMCache's side of ``kvbroker bench peer``: put+get times in kvbroker's own pattern.

Run it with a Python that has the ``lmcache`` wheel (0.5.6; its CPU set-up is in
docs/operating.md, "Comparing with LMCache"). kvbroker is not needed there.
``kvbroker bench peer --lmcache-python PYTHON`` runs it beside Mooncake's driver and kvbroker's
``transfer`` scenario on the same sizes and compares the medians.

What it does:

- starts a private LMCache multiprocess server (``lmcache server``) on 127.0.0.1 (a free port)
  in ``engine_driven`` transfer mode with a shared-memory segment (``--shm-name``): the mode
  LMCache serves non-CUDA workers with, the bytes moving through that segment, the control
  through ZMQ requests (PREPARE / COMMIT of a store or a retrieve);
- per size, registers one worker (LMCache's own ``EngineDrivenTransferContext``, what its vLLM
  adapter uses on CPU) with a vLLM-shaped paged KV cache on the CPU whose one chunk
  (``--chunk-size`` tokens, LMCache's unit of storage) is exactly that size: LMCache stores KV
  caches, not opaque objects, so an "object" is one chunk;
- runs kvbroker's ``transfer`` loop: 3 untimed warm-up round trips, then ``--ops`` times: a
  memcpy of the chunk's bytes (timed on its own, as kvbroker does), ``submit_store`` of the
  chunk's blocks (the put: prepare, gather into the segment, commit), ``submit_retrieve`` into
  other blocks (the get, as LMCache's SGLang and vLLM adapters do it: LOOKUP, which prefetches
  and locks the chunk, ``wait_prefetch_status``, then prepare, scatter from the segment,
  commit), each timed, the retrieved
  blocks compared with the stored ones, everything dropped (``clear``, untimed: LMCache has no
  per-key remove). Every round trip's tokens and bytes differ (a stamp), so a retrieve that
  returned another chunk, or nothing, is caught;
- stops the server (by process id) and writes JSON.

Output (``--json-out``), the shape ``kvbroker/_bench/peer.py`` reads from every peer driver: a
list with one entry, ``{"mode": "engine_driven", "setup_s", "lmcache", "sizes": [{"size",
"put": STATS, "get": STATS, "memcpy": STATS, "data_ok", "errors", "kv_shape"}]}``, STATS being
``{"n", "median_ms", "p90_ms", "p99_ms", "GBps_at_median"}``. A failed run is ``{"mode",
"error"}`` and exit status 1. GB/s use 10^9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by file path
from latency_stats import stats  # benchmarks/latency_stats.py, beside this file

KiB, MiB = 1 << 10, 1 << 20
MODE = "engine_driven"
WARMUP = 3
BLOCK = 16  # tokens per paged-KV block (vLLM's default)
INSTANCE_BASE = 2000


def kv_shape(size: int, chunk: int) -> tuple[int, int, int]:
    """(layers, heads, head_size) of a float16 K/V cache whose chunk of ``chunk`` tokens is
    ``size`` bytes; ValueError where none is."""
    per_token = size // chunk
    if per_token * chunk != size or per_token % (2 * 2 * 64):
        raise ValueError(f"{size} bytes is not {chunk} tokens of float16 K/V with heads of 64")
    planes = per_token // (2 * 2 * 64)  # layers x heads, heads of 64 elements
    for layers in (32, 16, 8, 4, 2, 1):  # a model-like depth first
        if planes % layers == 0 and planes // layers <= 16:
            return layers, planes // layers, 64
    return 1, planes, 64


def die_with_parent() -> None:  # in the child between fork and exec (Linux)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmcache_version():
    with contextlib.suppress(Exception):
        from importlib import metadata

        return metadata.version("lmcache")
    return None


@contextlib.contextmanager
def server(chunk: int, l1_gb: float, workdir: str, patience: float = 180.0):
    """A private ``lmcache server``; yields its ZMQ URL. Its log: ``workdir/server.log``."""
    port, http_port = free_port(), free_port()
    shm = f"kvb-peer-lmcache-{os.getpid()}"
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
    cmd = [
        exe,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chunk-size",
        str(chunk),
        "--supported-transfer-mode",
        MODE,
        "--shm-name",
        shm,
        "--l1-size-gb",
        str(l1_gb),
        "--no-l1-use-lazy",
        "--eviction-policy",
        "LRU",
        "--max-workers",
        "1",
        "--http-port",
        str(http_port),
    ]
    log = open(os.path.join(workdir, "server.log"), "wb")  # noqa: SIM115  (the server's)
    # its own process group (stopped whole), and SIGTERM should this driver die first (killed
    # by the runner's timeout): a server outliving it would keep its segment and ports
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )  # noqa: PLW1509  (one thread here)
    try:
        end = time.monotonic() + patience
        while True:  # ready when its port answers
            if proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {proc.returncode}: " + tail(workdir)
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > end:
                raise RuntimeError("lmcache server did not open its port: " + tail(workdir))
            time.sleep(0.5)
        yield f"tcp://127.0.0.1:{port}", " ".join(cmd)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        for path in glob.glob(f"/dev/shm/*{shm}*"):  # the server names its L1 pool after it
            with contextlib.suppress(OSError):
                os.unlink(path)


def tail(workdir: str) -> str:
    with (
        contextlib.suppress(OSError),
        open(os.path.join(workdir, "server.log"), errors="replace") as f,
    ):
        return f.read()[-3000:]
    return ""


def call(future, timeout=30.0):
    return future.result(timeout=timeout)


def measure_size(client, size: int, chunk: int, ops: int, instance: int, deadline: float) -> dict:
    """kvbroker's transfer loop on one chunk-sized KV layout."""
    import torch
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext

    layers, heads, head = kv_shape(size, chunk)
    blocks = chunk // BLOCK
    model = f"kvb-peer-{size}"
    # two chunks of blocks per layer: the put reads blocks [0, n), the get writes [n, 2n)
    caches = {
        f"layer.{i}": torch.empty((2, 2 * blocks, BLOCK, heads, head), dtype=torch.float16)
        for i in range(layers)
    }
    for t in caches.values():
        t.view(torch.int16).random_(-30000, 30000)
    src_ids, dst_ids = list(range(blocks)), list(range(blocks, 2 * blocks))
    ctx = EngineDrivenTransferContext(instance, client)
    ctx.register(
        caches,
        model,
        1,
        blocks,
        30.0,
        layout_hints={"kv_layout": "NHD"},
        engine_group_infos=[
            EngineGroupInfo(
                engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=BLOCK
            )
        ],
        engine_type=EngineType.VLLM,
    )
    flat = torch.empty(size // 2, dtype=torch.float16)  # the memcpy baseline's destination
    src_flat = torch.empty_like(flat).view(torch.int16).random_(-30000, 30000).view(torch.float16)
    cp, put, get, errors = [], [], [], []
    data_ok = True
    try:
        for i in range(WARMUP + ops):
            if time.time() > deadline:
                errors.append(f"time budget spent after {max(0, i - WARMUP)} timed round trips")
                break
            stamp = ((instance - INSTANCE_BASE) << 16) + i  # token ids are 32-bit on the wire
            for t in caches.values():  # this round trip's bytes
                t[0, 0, 0, 0, 0] = float(i % 1000)
                t[1, blocks - 1, BLOCK - 1, heads - 1, head - 1] = float(stamp % 1000)
                t[:, blocks:].zero_()
            key = IPCCacheServerKey(
                model_name=model,
                world_size=1,
                num_kv_readers=1,
                worker_id=0,
                token_ids=(stamp,) + (7,) * (chunk - 1),
                start=0,
                end=chunk,
                request_id=f"r{stamp}",
            )
            t0 = time.perf_counter()
            flat.copy_(src_flat)
            t1 = time.perf_counter()
            ok_put = call(ctx.submit_store(key.request_id, key, caches, [src_ids], None, blocks))
            t2 = time.perf_counter()
            if not ok_put:
                errors.append(f"store {i} returned {ok_put}")
                break
            # the get as LMCache's adapters do it: LOOKUP (which prefetches and locks the
            # chunks), wait for the prefetch, then PREPARE/scatter/COMMIT the retrieve
            call(client.lookup(key, 1))
            hit = call(client.wait_prefetch_status(key.request_id, 30.0), 60.0)
            ok_get = hit == 1 and call(
                ctx.submit_retrieve(key.request_id, key, caches, [dst_ids], None, blocks)
            )
            t3 = time.perf_counter()
            if not ok_get:
                errors.append(f"get {i}: lookup found {hit} chunks of 1, retrieve {ok_get}")
                break
            for t in caches.values():
                if not torch.equal(
                    t[:, :blocks].view(torch.int16), t[:, blocks:].view(torch.int16)
                ):
                    data_ok = False
                    errors.append(f"retrieve {i}: bytes differ from what was stored")
                    break
            call(client.end_session(key.request_id))
            call(client.clear(True))
            if i >= WARMUP:
                cp.append(t1 - t0)
                put.append(t2 - t1)
                get.append(t3 - t2)
    finally:
        with contextlib.suppress(Exception):
            call(ctx.unregister())
        ctx.close()
    return {
        "size": size,
        "put": stats(put, size),
        "get": stats(get, size),
        "memcpy": stats(cp, size),
        "data_ok": data_ok,
        "errors": errors[:5],
        "kv_shape": {
            "layers": layers,
            "heads": heads,
            "head_size": head,
            "block_tokens": BLOCK,
            "chunk_tokens": chunk,
            "dtype": "float16",
        },
    }


def run(sizes, ops: int, chunk: int, l1_gb: float, budget: float, workdir: str) -> dict:
    import zmq
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    t0 = time.perf_counter()
    deadline = time.time() + budget
    with server(chunk, l1_gb, workdir) as (url, cmd):
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        client = RequestClientFactory.create(url, context=ctx)
        try:
            got = call(client.get_chunk_size())
            if int(got) != chunk:
                raise RuntimeError(f"the server's chunk size is {got}, not {chunk}")
            setup = time.perf_counter() - t0
            out = [
                measure_size(client, s, chunk, ops, INSTANCE_BASE + n, deadline)
                for n, s in enumerate(sizes)
            ]
        finally:
            client.close()
            ctx.term()
    return {
        "mode": MODE,
        "setup_s": setup,
        "lmcache": lmcache_version(),
        "server": cmd,
        "sizes": out,
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
    ap.add_argument("--modes", default=MODE, help=f"only {MODE} (the CPU-served mode)")
    ap.add_argument("--chunk-size", type=int, default=256, help="tokens per LMCache chunk")
    ap.add_argument("--l1-size-gb", type=float, default=1.0)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds for all sizes")
    ap.add_argument("--workdir")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    workdir = a.workdir or tempfile.mkdtemp(prefix="kvb-lmcache-")
    os.makedirs(workdir, exist_ok=True)
    if a.modes != MODE:
        result = {"mode": a.modes, "error": f"only the {MODE} mode is driven"}
    else:
        try:
            result = run(sizes, a.ops, a.chunk_size, a.l1_size_gb, a.budget, workdir)
        except Exception as exc:  # noqa: BLE001  (reported in the JSON, as the contract says)
            result = {"mode": MODE, "error": f"{type(exc).__name__}: {exc}"}
    failed = "error" in result or any(z["errors"] for z in result["sizes"])
    text = json.dumps([result], indent=1)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
