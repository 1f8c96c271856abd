"""Where the time of the vLLM connector's CUDA save and load goes: wall time per phase.

Runs ``_cuda.save_cuda`` / ``load_cuda`` on a Llama-3-8B-shaped 16k-token KV (as
``bench_vllm_gpu.py``) with the control-plane calls, the copies and the waits wrapped in
timers; with ``--daemon-profile`` the daemon runs under cProfile (its top functions printed
at the end); with ``--timeline N`` the first N steps of the last save on the Python thread
(each reservation sent and answered, block ids uploaded, checksums set up, DMA queued, seal
queued), in ms from the call's start. Usage: ``python benchmarks/experiments/profile_vllm_gpu.py
[--tokens 16384] [--reps 3] [--cpu] [--daemon-profile] [--no-checksums] [--timeline N]``.
"""

from __future__ import annotations

from itertools import pairwise
import argparse
import collections
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_vllm_gpu import vllm_cache

from kvbroker import Client
from kvbroker._bench._common import invocation, machine_info, measured_commit
from kvbroker import blocks
from kvbroker.integrations.vllm import _cuda, _paged
from kvbroker.integrations.vllm._format import BlockFormat
from kvbroker.integrations.vllm._paged import SaveItem, copier_for, cuda_cache

SPENT: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)
TIMELINE: list = []  # (host time a DMA was queued, its start and end events)
STEPS: list = []  # (step, host start, host end) of the current save, with --timeline


def _wrapped(fn, record):
    """``fn``, each call's start and end (host clock) passed to ``record``."""

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            record(t0, time.perf_counter())

    return wrapper


def stepped(name, fn):
    """``fn``, its calls recorded in STEPS."""
    return _wrapped(fn, lambda t0, t1: STEPS.append((name, t0, t1)))


def timed(name, fn):
    """``fn``, its calls counted in CALLS and their time added to SPENT."""

    def record(t0, t1):
        SPENT[name] += t1 - t0
        CALLS[name] += 1

    return _wrapped(fn, record)


def gpu_split(src, fmt, nblk, client) -> None:
    """CUDA-event times of the save's two GPU stages over all blocks, each alone: the
    gather into staging (index_select + permuted copy) and the D2H DMA of 2 MiB runs into
    the registered pool (one run per block, as a fragmented pool would give, and one run for
    everything)."""
    from kvbroker._bench.gpu_run import events_median

    L, C, _B, N, H, D = src.shape
    chunk = 64
    staging = torch.empty((chunk, L, C, H, N, D), dtype=src.dtype, device=src.device)
    ids = [torch.arange(at, at + chunk, device=src.device) for at in range(0, nblk, chunk)]

    def gather():
        for i in ids:
            staging.copy_(src.index_select(2, i).permute(2, 0, 1, 4, 3, 5))

    t = events_median(gather, 5)
    print(f"  gpu: gather of every block     {t * 1e3:8.1f} ms")
    lease = client.reserve("dma-probe", {"kv": nblk * fmt.block_nbytes}, namespace="probe")
    view = lease["kv"]
    host = view.__array_interface__["data"][0]  # a numpy view of the lease's extent
    stream = torch.cuda.current_stream()
    per = fmt.block_nbytes
    dev = staging.data_ptr()
    per_block = [(host + j * per, dev + (j % chunk) * per, per) for j in range(nblk)]
    t1 = events_median(lambda: _copy_each(per_block, stream), 5)
    print(f"  gpu: D2H 2 MiB runs, separate  {t1 * 1e3:8.1f} ms")
    lease.abort()


def _copy_each(runs, stream) -> None:
    from kvbroker._client.gpu_copy import _driver

    lib = _driver()
    import ctypes

    handle = ctypes.c_void_p(stream.cuda_stream)
    for dst, src, n in runs:
        lib.cuMemcpyAsync(dst, src, n, handle)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--daemon-profile", action="store_true", help="run the daemon under cProfile")
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="seal without the GPU checksums (what they cost, side by side)",
    )
    p.add_argument(
        "--timeline",
        type=int,
        default=0,
        metavar="N",
        help="print the first N steps of the last save on the Python thread",
    )
    a = p.parse_args()
    m = machine_info()
    print(
        f"commit {measured_commit()}; {m['cpu']}, {m['cores']} CPUs, {m['when']}; "
        f"`python benchmarks/experiments/{invocation()}`"
    )
    device = torch.device("cpu" if a.cpu else "cuda")
    L, H, D, page = 32, 8, 128, 16
    nblk = a.tokens // page
    fmt = BlockFormat(
        dtype="bfloat16",
        num_layers=L,
        block_size=page,
        head_dim=D,
        local_heads=H,
        total_kv_heads=H,
        tp_rank=0,
        tp_size=1,
        heads=(0, H),
    )
    nbytes = nblk * fmt.block_nbytes
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    prof = os.path.join(d, "daemon.prof")
    profiled = ["-m", "cProfile", "-o", prof] if a.daemon_profile else []
    daemon = subprocess.Popen(
        [
            sys.executable,
            *profiled,
            "-m",
            "kvbroker",
            "serve",
            "--socket",
            sock,
            "--pool-size",
            f"{(nbytes >> 20) + 512}M",
            "--page-size",
            "2M",
            "--log-level",
            "warning",
        ]
    )
    for _ in range(600):
        try:
            Client(sock, map_pools=False).close()
            break
        except Exception:  # noqa: BLE001
            time.sleep(0.1)
    client = Client(sock)
    src = cuda_cache(vllm_cache(L, nblk, H, page, D, device, "NHD"), "packed")
    dst = cuda_cache(vllm_cache(L, nblk, H, page, D, device, "NHD", seed=1), "packed")
    if device.type == "cuda":
        from kvbroker.gpu import GpuClient

        g = GpuClient(client, device=device)
        stream, copier = g.stream, None
        queue = copier_for("cuda")

        def counted(runs, stream):
            CALLS["dma runs"] += len(runs)
            now = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out = queue(runs, stream)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            TIMELINE.append((now, start, end))
            return out

        copier = timed("dma queue", counted)
    else:
        stream, copier = None, timed("memmove", copier_for("cpu"))
    blocks.PendingReservation.result = timed(
        "wait for a reservation", blocks.PendingReservation.result
    )
    blocks.seal_later = timed("queue a seal", blocks.seal_later)
    _paged.match = timed("match round trip", _paged.match)
    _cuda.match = _paged.match
    if device.type == "cuda":
        torch.cuda.Event.synchronize = timed("wait for a chunk's DMA", torch.cuda.Event.synchronize)
    if a.timeline:
        blocks.reserve_later = stepped("reservation sent", blocks.reserve_later)
        blocks.PendingReservation.result = stepped(
            "reservation answered", blocks.PendingReservation.result
        )
        _cuda._ids_on = stepped("block ids to the GPU", _cuda._ids_on)
        blocks.start_device_checksums = stepped("checksums set up", blocks.start_device_checksums)
        _cuda._seal_later = stepped("seal queued", _cuda._seal_later)
        copier = stepped("DMA queued", copier)
    for rep in range(a.reps + 1):
        if rep == 1:
            SPENT.clear()
            CALLS.clear()
        hashes = [f"{rep:08x}{i:024x}" for i in range(nblk)]
        items = [SaveItem(h, hashes[i - 1] if i else None, i) for i, h in enumerate(hashes)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        TIMELINE.clear()
        STEPS.clear()
        t0 = time.perf_counter()
        last_start = t0
        _cuda.save_cuda(
            client,
            "ns",
            fmt,
            src,
            items,
            stream=stream,
            copier=copier,
            checksums=not a.no_checksums,
        )
        if a.timeline:  # (the load's steps are not the save's)
            saved_steps = list(STEPS)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if rep and TIMELINE:  # when the DMAs were queued, and how long the DMA stream idled
            first, last = TIMELINE[0], TIMELINE[-1]
            SPENT["first DMA queued after"] += first[0] - t0
            SPENT["last DMA queued after"] += last[0] - t0
            SPENT["DMA stream: first start to last end"] += first[1].elapsed_time(last[2]) / 1e3
            SPENT["DMA stream: busy"] += sum(s.elapsed_time(e) for _, s, e in TIMELINE) / 1e3
            gaps = [a[2].elapsed_time(b[1]) / 1e3 for a, b in pairwise(TIMELINE)]
            SPENT["DMA stream: idle between DMAs"] += sum(gaps)
            SPENT["DMA stream: largest idle gap"] += max(gaps, default=0.0)
        _cuda.load_cuda(
            client, "ns", fmt, dst, hashes, list(range(nblk)), stream=stream, copier=copier
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if rep:
            SPENT["save (whole call)"] += t1 - t0
            SPENT["load (whole call)"] += t2 - t1
        client.evict(namespace="ns")
    if device.type == "cuda":  # the GPU side alone: gather without DMA, DMA of the same runs
        gpu_split(src, fmt, nblk, client)
    if a.timeline:
        print(f"the last save's first {a.timeline} steps, ms from its start (begin - end):")
        for name, begin, end in saved_steps[: a.timeline]:
            begin, end = (begin - last_start) * 1e3, (end - last_start) * 1e3
            print(f"  {name:24s} {begin:8.3f} - {end:8.3f}")
    print(
        f"{nblk} blocks, {nbytes / 2**30:.2f} GiB, per save/load (mean of {a.reps}); "
        f"{CALLS.pop('dma runs', 0) / a.reps / 2:.0f} DMA runs per save or load:"
    )
    for name, s in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        print(
            f"  {name:28s} {s / a.reps * 1e3:8.1f} ms  ({CALLS.get(name, a.reps) // a.reps} calls)"
        )
    client.close()
    daemon.send_signal(signal.SIGINT)
    daemon.wait(60)
    if a.daemon_profile:
        print("daemon, top functions by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
