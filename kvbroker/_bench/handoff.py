"""The vLLM connector's same-node handoff, timed: a prefill process publishes a request's KV
into a daemon GPU ring (``integrations.vllm._handoff.publish_runs``: gather from its paged
cache straight into the ring region, seal), a decode process finds it and scatters it into
its own paged cache (``find_runs`` + ``load_runs``, the ring mapped over CUDA IPC).

Used by ``benchmarks/bench_vllm_gpu.py --handoff``. Two processes (as in a deployment: the
ring is mapped over CUDA IPC by both), on one GPU or, with two, the producer on GPU 0 and
the consumer on GPU 1 (the scatter reads the producer's ring over NVLink). Timed per round:
the producer's call (wall, from its first gather to the seal) and the consumer's (lookup,
scatter, synchronized), sequential as in a P/D handoff (end of prefill to KV in the decode
engine's cache); against a copy of the same bytes on the same device(s) (CUDA events),
timed in the same rounds. The first round is a warm-up and checks the bytes (a digest of
sampled blocks on each side).

``python -m kvbroker._bench.handoff produce SOCK ...`` is the producer process (driven by
lines on stdin: ``rep K`` or ``quit``; answers one JSON line per round).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

NS = "vllm/bench-handoff"
FIRST = 8  # the producer's blocks are FIRST.., the consumer's the other way round


def vllm_cache(layers, blocks, heads, page, dim, device, order, seed=0):
    """Per-layer ``[blocks, heads, page, 2*dim]`` bf16 views of one allocation, like vLLM's."""
    import torch

    c = 2 * dim
    raw = torch.empty(layers * blocks * heads * page * c, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw.view(torch.int16).random_(-30000, 30000, generator=g)
    if order == "NHD":
        strides = (blocks * page * heads * c, page * heads * c, c, heads * c, 1)
    else:
        strides = (blocks * heads * page * c, heads * page * c, page * c, c, 1)
    five = torch.as_strided(raw, (layers, blocks, heads, page, c), strides)
    return [five[i] for i in range(layers)]


def _fmt(L, H, D, page):
    from kvbroker.integrations.vllm._format import BlockFormat

    return BlockFormat(
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


def _hashes(rep: int, nblk: int) -> list[str]:
    return [f"{rep:08x}{i:024x}" for i in range(nblk)]


def _digest(c6, ids) -> str:
    import torch

    h = hashlib.sha256()
    for i in ids:
        h.update(c6[:, :, i].contiguous().view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()


def _sample(nblk: int) -> list[int]:
    return list(range(0, nblk, max(1, nblk // 16)))


def produce(
    sock: str, L: int, H: int, D: int, page: int, nblk: int, order: str, device: str
) -> None:
    import torch

    from kvbroker import Client
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._handoff import HandoffConfig, publish_runs
    from kvbroker.integrations.vllm._paged import SaveItem, cuda_cache

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    src6 = cuda_cache(vllm_cache(L, nblk + FIRST, H, page, D, dev, order), "packed")
    fmt = _fmt(L, H, D, page)
    with GpuClient(Client(sock), own_client=True, device=dev) as g:
        print(
            json.dumps(
                {"ready": True, "digest": _digest(src6, [FIRST + i for i in _sample(nblk)])}
            ),
            flush=True,
        )
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            hashes = _hashes(int(cmd[1]), nblk)
            items = [
                SaveItem(h, hashes[i - 1] if i else None, FIRST + i) for i, h in enumerate(hashes)
            ]
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            done, n, nbytes = publish_runs(
                g, NS, src6, fmt, [("req", items)], HandoffConfig("ring"), stream=g.stream
            )
            t1 = time.perf_counter()
            print(
                json.dumps(
                    {
                        "publish_s": t1 - t0,
                        "blocks": n,
                        "bytes": nbytes,
                        "handed_off": done == ["req"],
                    }
                ),
                flush=True,
            )


def bench_handoff(sock: str, a, producer_device: str, consumer_device: str) -> dict:
    """The rounds, against a daemon serving ``--gpu-ring`` at ``sock``."""
    import torch

    from kvbroker import Client
    from kvbroker._bench.gpu_run import events_median
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._handoff import find_runs, load_runs
    from kvbroker.integrations.vllm._paged import cuda_cache

    L, H, D, page = a.layers, a.heads, a.head_dim, a.block_size
    nblk = a.tokens // page
    fmt = _fmt(L, H, D, page)
    nbytes = nblk * fmt.block_nbytes
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
    prod = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbroker._bench.handoff",
            "produce",
            sock,
            str(L),
            str(H),
            str(D),
            str(page),
            str(nblk),
            a.order,
            producer_device,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    res: dict = {
        "kv_bytes": nbytes,
        "blocks": nblk,
        "order": a.order,
        "producer": producer_device,
        "consumer": consumer_device,
    }
    try:
        hello = json.loads(prod.stdout.readline())
        dev = torch.device(consumer_device)
        torch.cuda.set_device(dev)
        dst6 = cuda_cache(vllm_cache(L, nblk + FIRST, H, page, D, dev, a.order, seed=1), "packed")
        dst_ids = list(range(nblk))[::-1]
        # the raw copy of the same bytes, producer's device to consumer's, same rounds
        x = torch.empty(nbytes, dtype=torch.uint8, device=producer_device)
        y = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        rounds = []
        with GpuClient(Client(sock), own_client=True, device=dev) as g:
            for rep in range(a.reps + 1):
                prod.stdin.write(f"rep {rep}\n")
                prod.stdin.flush()
                p = json.loads(prod.stdout.readline())
                assert p["handed_off"], f"the ring did not take the run: {p}"
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                runs = find_runs(
                    g.client, NS, _hashes(rep, nblk), heads=H, consumer_tp=1, producer_tps=[1]
                )
                loaded, _ = load_runs(g, NS, dst6, fmt, dst_ids, runs, 0, stream=g.stream)
                torch.cuda.synchronize(dev)
                t1 = time.perf_counter()
                assert loaded == nblk, (loaded, nblk)
                copy_s = events_median(lambda: y.copy_(x), 3)
                if rep == 0:
                    got = _digest(dst6, [dst_ids[i] for i in _sample(nblk)])
                    res["bit_exact"] = got == hello["digest"]
                    continue
                handoff = p["publish_s"] + (t1 - t0)
                rounds.append(
                    {
                        "publish_s": p["publish_s"],
                        "load_s": t1 - t0,
                        "handoff_s": handoff,
                        "copy_s": copy_s,
                        "ratio": copy_s / handoff,
                    }
                )
            res["rings_after"] = [
                {k: r[k] for k in ("used", "objects")} for r in g.client.stat().rings
            ]
        res["rounds"] = rounds
        for k in ("publish_s", "load_s", "handoff_s", "copy_s", "ratio"):
            res[k] = statistics.median(r[k] for r in rounds)
        res["ratio_range"] = [min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds)]
        res["handoff_GBps"] = nbytes / res["handoff_s"] / 1e9
        res["copy_GBps"] = nbytes / res["copy_s"] / 1e9
    finally:
        try:
            prod.stdin.write("quit\n")
            prod.stdin.flush()
        except OSError:
            pass
        prod.wait(60)
    return res


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "produce":
        s, L, H, D, page, nblk, order, device = sys.argv[2:10]
        produce(s, int(L), int(H), int(D), int(page), int(nblk), order, device)
