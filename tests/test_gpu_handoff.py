"""Same-node P/D handoff through real GPU staging rings (``serve --gpu-ring``): CUDA IPC
between processes on one device, bit-exact, and processes killed mid-handoff. Skips without
CUDA; needs no vLLM engine (the connector's halves are driven directly).

Two processes on one GPU exercise every CUDA IPC path the two-GPU deployment takes (the
daemon allocates and exports each ring; every other process maps it with
``cuIpcOpenMemHandle``); only the peer copy over NVLink needs a second GPU (the last test).
``tests/test_vllm_handoff.py`` runs the same code on CPU tensors against fake rings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TESTS = os.path.dirname(os.path.abspath(__file__))
NS = "vllm/gpu-handoff"
HASHES = [f"{i:032x}" for i in range(1, 9)]
L, B, H, N, D = 4, 24, 8, 16, 64
SRC_IDS = [7, 2, 9, 0, 4, 11, 13, 21]


@pytest.fixture
def gpu_ring_daemon(make_daemon):
    return make_daemon("--pool-size", "256M", "--page-size", "64K", "--gpu-ring", "64M")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path])}


_PRODUCER = textwrap.dedent("""
    import sys, torch
    from test_vllm_gpu import vllm_like, _fmt
    from kvbroker import Client
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._handoff import HandoffConfig, publish_runs
    from kvbroker.integrations.vllm._paged import SaveItem, cuda_cache
    sock, order, ptp, dtp, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    L, B, H, N, D = {shape}
    hashes, ids = {hashes}, {ids}
    items = [SaveItem(h, hashes[i - 1] if i else None, b) for i, (h, b) in enumerate(zip(hashes, ids))]
    full, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND")
    per = H // ptp
    with GpuClient(Client(sock), own_client=True, device=device) as g:
        for r in range(ptp):  # each producer rank's heads, as its own worker would
            mine, _ = vllm_like(L, B, per, N, D, torch.bfloat16, device, order, seed=9)
            for layer in range(L):
                mine[layer].copy_(full[layer][:, r * per : (r + 1) * per])
            fmt = _fmt(L, per, N, D, torch.bfloat16, r, ptp, total=H)
            cfg = HandoffConfig("ring", consumer_tp=dtp)
            for step in (items[:5], items[5:]):  # two steps of a chunked prefill
                done, n, _ = publish_runs(g, "{ns}", cuda_cache(mine, "packed"), fmt,
                                          [("req", step)], cfg, stream=g.stream)
                assert done == ["req"] and n == len(step), (done, n)
    print("published", flush=True)
""").format(shape=(L, B, H, N, D), hashes=HASHES, ids=SRC_IDS, ns=NS)


def _bits(t):
    return t.contiguous().view(torch.int16)


def _consume(sock, order, ptp, dtp, device="cuda:0"):
    """This process as the decode engine's ranks: look the runs up, scatter them; checked
    against the prefill engine's cache, bit for bit."""
    from test_vllm_gpu import _fmt, vllm_like

    from kvbroker import Client
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._handoff import find_runs, load_runs
    from kvbroker.integrations.vllm._paged import cuda_cache

    full, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND")
    f6 = cuda_cache(full, "packed")
    dst_ids = [5, 3, 8, 6, 2, 0, 22, 23]
    per = H // dtp
    with GpuClient(Client(sock), own_client=True, device=device) as g:
        runs = find_runs(g.client, NS, HASHES, heads=H, consumer_tp=dtp, producer_tps=[dtp, ptp])
        assert [(r.start, r.count) for r in runs] == [(0, 5), (5, 3)]
        for r in range(dtp):
            out, _ = vllm_like(L, B, per, N, D, torch.bfloat16, device, order, seed=5)
            o6 = cuda_cache(out, "packed")
            before = o6.clone()
            fmt = _fmt(L, per, N, D, torch.bfloat16, r, dtp, total=H)
            assert load_runs(g, NS, o6, fmt, dst_ids, runs, 0, stream=g.stream)[0] == 8
            torch.cuda.synchronize()
            for a, b in zip(SRC_IDS, dst_ids, strict=True):
                assert torch.equal(
                    _bits(o6[:, :, b].cpu()), _bits(f6[:, :, a, :, r * per : (r + 1) * per])
                )
            rest = [i for i in range(B) if i not in dst_ids]
            assert torch.equal(_bits(o6[:, :, rest]), _bits(before[:, :, rest]))
        return g.client.stat().rings


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (2, 1), (1, 2)])
def test_a_prefill_process_hands_off_to_a_decode_process_over_cuda_ipc(
    gpu_ring_daemon, order, ptp, dtp
):
    script = _PRODUCER
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            gpu_ring_daemon.socket_path,
            order,
            str(ptp),
            str(dtp),
            "cuda:0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert out.returncode == 0 and "published" in out.stdout, out.stderr[-3000:]
    rings = _consume(gpu_ring_daemon.socket_path, order, ptp, dtp)
    # every run was read once by the one decode rank it was for, and freed
    assert all((r["used"], r["objects"], r["leased_read"]) == (0, 0, 0) for r in rings)


_HOLD = textwrap.dedent("""
    import sys, time, torch
    from kvbroker import Client
    from kvbroker.gpu import GpuClient
    sock, role, key = sys.argv[1], sys.argv[2], sys.argv[3]
    g = GpuClient(Client(sock), own_client=True)
    if role == "producer":  # writing its run through the IPC mapping, never sealing it
        region = g.ring_reserve(8 << 20, key=key, namespace="{ns}", meta={{"kvbroker.handoff": 1}})
        region.tensor.fill_(7)
    else:  # reading a run, never releasing it
        region = g.ring_read(key, namespace="{ns}")
        float(region.tensor[:1 << 20].float().sum())
    torch.cuda.synchronize()
    print("holding", flush=True)
    time.sleep(120)
""").format(ns=NS)


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_process_killed_mid_handoff_leaves_no_ring_space_held(gpu_ring_daemon, role):
    from kvbroker import Client
    from kvbroker.gpu import GpuClient

    key = "run-of-a-killed-process"
    with GpuClient(Client(gpu_ring_daemon.socket_path), own_client=True) as g:
        src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        if role == "consumer":
            region = g.ring_reserve(src.numel() * 4, key=key, namespace=NS, ttl=600)
            region.tensor.view(torch.int32).copy_(src)
            torch.cuda.synchronize()
            region.seal()
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD, gpu_ring_daemon.socket_path, role, key],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        try:
            assert proc.stdout.readline().strip() == "holding"
            ring = g.client.stat().rings[g.local_ring()]
            assert ring["leased_write" if role == "producer" else "leased_read"] >= 4 << 20
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        deadline = time.monotonic() + 20
        busy = ("leased_write", "leased_read")
        while (
            any(g.client.stat().rings[g.local_ring()][k] for k in busy)
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        ring = g.client.stat().rings[g.local_ring()]
        assert (ring["leased_write"], ring["leased_read"]) == (0, 0)
        if role == "producer":  # the half-written run was discarded, never visible
            assert (ring["used"], ring["objects"]) == (0, 0)
            assert g.client.ops.ring_lookup([key], namespace=NS)["objects"] == [None]
        else:  # the run came back for a retry: read whole, then freed
            out = torch.empty_like(src)
            with g.ring_read(key, namespace=NS) as region:
                out.copy_(region.tensor.view(torch.int32))
                torch.cuda.synchronize()
            assert torch.equal(out, src)
            ring = g.client.stat().rings[g.local_ring()]
            assert (ring["used"], ring["objects"]) == (0, 0)


@pytest.mark.parametrize("mode", ["ring", "ring+host"])
def test_the_connector_worker_hands_off_on_cuda_then_loads_ring_first(gpu_ring_daemon, mode):
    from test_vllm_gpu import _fmt, _items, vllm_like

    from kvbroker import Client
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations._link import Warnings
    from kvbroker.integrations.vllm._handoff import HandoffConfig, find_runs
    from kvbroker.integrations.vllm._paged import cuda_cache
    from kvbroker.integrations.vllm._scheduler import LoadSpec
    from kvbroker.integrations.vllm._worker import WorkerSide

    fmt = _fmt(L, H, N, D, torch.bfloat16)

    def worker(cache):
        w = WorkerSide(
            link=None,
            namespace=NS,
            block_size=N,
            total_kv_heads=H,
            latent=False,
            tp_rank=0,
            tp_size=1,
            warnings=Warnings(),
            handoff=HandoffConfig(mode),
        )
        w.fmt, w.cache = fmt, cuda_cache(cache, "packed")
        w.device, w.cuda_device = "cuda", cache[0].device
        return w

    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", "NHD")
    out, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", "NHD", seed=3)
    with Client(gpu_ring_daemon.socket_path) as c:
        prod, cons = worker(src), worker(out)
        g = prod._gpu_client(c)
        items = _items(HASHES, SRC_IDS)
        host = prod._hand_off(g, [("a", items)], items)
        assert host == (items if mode == "ring+host" else [])
        from kvbroker.integrations.vllm._cuda import save_cuda

        save_cuda(c, NS, fmt, prod.cache, host, stream=g.stream)
        runs = find_runs(c, NS, HASHES, heads=H, consumer_tp=1, producer_tps=[1])
        dst = [1, 3, 5, 8, 10, 12, 14, 16]
        spec = LoadSpec("a", HASHES, dst, ring=tuple(runs))
        cons._gpu = GpuClient(c, own_client=False)
        assert cons._load_cuda(spec, c, cons._gpu.stream) == 8 and spec.ring_loaded == 8
        torch.cuda.synchronize()
        for a, b in zip(SRC_IDS, dst, strict=True):
            assert torch.equal(_bits(cons.cache[:, :, b]), _bits(prod.cache[:, :, a]))
        assert c.stat().rings[g.local_ring()]["used"] == 0
        assert bool(c.ops.match_prefix(HASHES[:1], namespace=NS, hold=False)["matched"]) == (
            mode == "ring+host"
        )  # the host pools keep a copy only with ring+host
        cons._gpu.close()
        prod._gpu.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_prefill_process_on_gpu0_hands_off_to_a_decode_rank_on_gpu1(gpu_ring_daemon):
    out = subprocess.run(
        [sys.executable, "-c", _PRODUCER, gpu_ring_daemon.socket_path, "NHD", "1", "1", "cuda:0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert out.returncode == 0 and "published" in out.stdout, out.stderr[-3000:]
    rings = _consume(gpu_ring_daemon.socket_path, "NHD", 1, 1, device="cuda:1")
    assert all(r["used"] == 0 for r in rings)
