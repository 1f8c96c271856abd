"""The GPU data path: clean errors without CUDA, host tensors over leases, and (with CUDA)
registered pools with one-DMA publish/claim ordered against the caller's stream."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbroker import gpu
from kvbroker.errors import KVBrokerError

torch = pytest.importorskip("torch")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_import_kvbroker_does_not_import_torch():
    code = "import sys, kvbroker, kvbroker.gpu, kvbroker._client.kernels; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_gpu_client_without_cuda_fails_clearly(daemon):
    with daemon.client() as c:
        with pytest.raises(KVBrokerError, match="needs CUDA"):
            gpu.GpuClient(c)
        assert gpu.registered_segments() == {}
    assert gpu.cuda_available() is False


def test_host_tensors_are_zero_copy_views_of_the_lease(client):
    data = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    with client.reserve("k", {"a": data.numel(), "empty": 0}) as lease:
        views = gpu.host_tensors(lease)
        assert views["empty"].numel() == 0
        views["a"].copy_(data)
        assert bytes(lease["a"]) == data.numpy().tobytes()  # written through the pool
        del views
    with client.claim("k") as lease:
        got = gpu.host_tensors(lease)["a"].view(torch.int8)
        assert torch.equal(got.view(torch.uint8), data)
        del got


def test_host_tensors_refuse_an_ended_lease(client):
    client.put("k", {"a": b"abcd"})
    lease = client.claim("k")
    lease.release()
    with pytest.raises(KVBrokerError, match="ended"):
        gpu.host_tensors(lease)


@CUDA
@pytest.mark.gpu
def test_publish_claim_round_trip_bit_exact(daemon):
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        src = {
            "k": torch.randint(
                -(2**15), 2**15, (4, 1024, 64), dtype=torch.int16, device="cuda"
            ).view(torch.bfloat16),  # NaN payloads included
            "v": torch.randn(333, device="cuda", dtype=torch.float32),
        }
        assert g.publish("req", src)
        assert not g.publish("req", src)  # exists: nothing copied
        out = {n: torch.empty_like(t) for n, t in src.items()}
        g.claim("req", out, consume=True)
        for n in src:
            assert torch.equal(out[n].view(torch.uint8), src[n].view(torch.uint8))
        assert not g.client.exists("req")


@CUDA
@pytest.mark.gpu
def test_a_cuda_publish_takes_a_session_as_client_put_does(daemon):
    # GpuClient.publish(session=...) is retained by that session once sealed, and a publish
    # that finds its key retains the object there (docs/sessions.md).
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        x = torch.arange(4096, device="cuda", dtype=torch.int32)
        assert g.publish("s1", {"x": x}, session="conv", retain="10m", priority=4)
        g.client.put("s2", {"x": b"abcd"})
        assert not g.publish("s2", {"x": x}, session="conv")
        (row,) = g.client.ops.sessions()["sessions"]
        assert (row["name"], row["blocks"], row["priority"]) == ("conv", 2, 4)


@CUDA
@pytest.mark.gpu
def test_registration_once_per_process_and_unregistered_at_close(daemon):
    c1, c2 = daemon.client(), daemon.client()
    names = {c1._mapping(p["index"]).name for p in c1.pools}
    g1 = gpu.GpuClient(c1, own_client=True)
    g2 = gpu.GpuClient(c2, own_client=True)
    assert {n: gpu.registered_segments()[n] for n in names} == {n: 2 for n in names}
    g1.close()
    assert all(gpu.registered_segments()[n] == 1 for n in names)
    g2.close()
    assert not names & set(gpu.registered_segments())


@CUDA
@pytest.mark.gpu
def test_publish_waits_for_the_producer_stream_and_claim_orders_the_consumer(daemon):
    producer = torch.cuda.Stream()
    x = torch.zeros(1 << 22, dtype=torch.int32, device="cuda")
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(50_000_000)  # the "forward pass" is still running
            x.fill_(7)
        assert g.publish("late", {"x": x}, stream=producer)
        out = {"x": torch.empty_like(x)}
        consumer = torch.cuda.Stream()
        g.claim("late", out, stream=consumer)
        with torch.cuda.stream(consumer):
            total = int(out["x"].sum().item())
        assert total == 7 * x.numel()


@CUDA
@pytest.mark.gpu
def test_non_contiguous_tensor_is_refused(daemon):
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        t = torch.zeros((8, 8), device="cuda").t()
        with pytest.raises(KVBrokerError, match="contiguous"):
            g.publish("nc", {"t": t})


@CUDA
@pytest.mark.gpu
def test_adjacent_buffers_move_in_one_dma(daemon):
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        whole = torch.randint(0, 256, (16, 4096), dtype=torch.uint8, device="cuda")
        tensors = {f"past_key.{i}": whole[i] for i in range(16)}  # 4096-byte rows: adjacent
        assert g.publish("adj", tensors)
        assert g.last_copies == 1  # 16 buffers, one DMA: sources and pool slices both adjacent
        out = torch.empty_like(whole)
        g.claim("adj", {f"past_key.{i}": out[i] for i in range(16)})
        assert g.last_copies == 1
        assert torch.equal(out, whole)


def test_coalesce_merges_only_runs_adjacent_on_both_sides():
    assert gpu.coalesce([(0, 100, 10), (10, 110, 5), (15, 200, 5), (30, 205, 1), (31, 0, 0)]) == [
        (0, 100, 15),
        (15, 200, 5),
        (30, 205, 1),
    ]


# ------------------------------------------------------------------------ daemon GPU rings
@pytest.fixture
def gpu_ring_daemon(make_daemon):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return make_daemon("--pool-size", "256M", "--page-size", "64K", "--gpu-ring", "64M")


@CUDA
@pytest.mark.gpu
def test_ring_handoff_round_trip_on_one_gpu(gpu_ring_daemon):
    with gpu.GpuClient(gpu_ring_daemon.client(), own_client=True) as g:
        rings = g.rings()
        assert len(rings) == torch.cuda.device_count() and rings[0]["capacity"] == 64 << 20
        src = {
            "k": torch.randint(-(2**31), 2**31 - 1, (1000, 33), dtype=torch.int32, device="cuda"),
            "v": torch.randn(777, device="cuda", dtype=torch.float16),
        }
        g.ring_publish("h", src, meta={"model": "m"})
        snap = g.client.stat().rings[g.local_ring()]
        assert snap["objects"] == 1 and snap["used"] > 0
        out = {n: torch.empty_like(t) for n, t in src.items()}
        g.ring_claim("h", out)
        for n in src:
            assert torch.equal(out[n].view(torch.uint8), src[n].view(torch.uint8))
        snap = g.client.stat().rings[g.local_ring()]
        assert (snap["objects"], snap["used"]) == (0, 0)  # consumed: the space is back


@CUDA
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ring_handoff_gpu0_to_gpu1_in_another_process(gpu_ring_daemon, tmp_path):
    """A prefill process on GPU 0 publishes into GPU 0's ring; this process, on GPU 1, claims
    with one peer copy; no host round trip."""
    script = tmp_path / "prefill.py"
    script.write_text(
        "import sys, torch\n"
        "from kvbroker import gpu\n"
        "torch.manual_seed(1)\n"
        "x = torch.randint(0, 2**15, (1 << 20,), dtype=torch.int16, device='cuda:0')\n"
        "with gpu.GpuClient(socket_path=sys.argv[1], device='cuda:0') as g:\n"
        "    g.ring_publish('req', {'kv': x})\n"
        "    print(int(x.to(torch.int64).sum()))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), gpu_ring_daemon.socket_path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    with gpu.GpuClient(gpu_ring_daemon.client(), own_client=True, device="cuda:1") as g:
        dst = torch.empty(1 << 20, dtype=torch.int16, device="cuda:1")
        g.ring_claim("req", {"kv": dst}, wait=10)
        assert g.last_copies == 1
        assert int(dst.to(torch.int64).sum()) == int(out.stdout.split()[-1])
        torch.manual_seed(1)
        ref = torch.randint(0, 2**15, (1 << 20,), dtype=torch.int16, device="cuda:0")
        assert torch.equal(dst.cpu(), ref.cpu())


def _paged(L, heads, blocks=64, page=16, dim=32, device="cuda"):
    return torch.randint(
        -(2**15), 2**15, (L, 2, blocks, page, heads, dim), dtype=torch.int16, device=device
    ).view(torch.bfloat16)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("ring", [True, False])
def test_heterogeneous_tp_p4_to_d1_on_cuda_matches_the_reference(ring, make_daemon):
    args = ["--pool-size", "256M", "--page-size", "64K"] + (["--gpu-ring", "64M"] if ring else [])
    d = make_daemon(*args)
    L, H, page, tokens = 4, 8, 16, 300
    full = _paged(L, H, page=page)  # the model's whole cache, as one engine would hold it
    with gpu.GpuClient(d.client(), own_client=True) as g:
        table = torch.randperm(64, device="cuda")[: -(-tokens // page)]
        for p in range(4):  # prefill ranks hold heads [2p, 2p+2)
            shard = full[:, :, :, :, 2 * p : 2 * p + 2].contiguous()
            res = gpu.publish_shard_cuda(
                g,
                "r",
                shard,
                table,
                tokens,
                tp_rank=p,
                tp_size=4,
                total_kv_heads=H,
                decode_tp_size=1,
            )
            assert res.published and res.copy_ops == 2  # one gather, one DMA
        dec = torch.zeros_like(full)
        dtable = torch.randperm(64, device="cuda")[: -(-tokens // page)]
        res = gpu.claim_shards_cuda(
            g, "r", dec, dtable, tp_rank=0, tp_size=1, prefill_tp_size=4, total_kv_heads=H
        )
        assert res.copy_ops == 4 * 2  # per shard: one DMA, one scatter
        assert res.num_tokens == tokens
        t = torch.arange(tokens, device="cuda")
        want = full[:, :, table[t // page], t % page].view(torch.int16)
        got = dec[:, :, dtable[t // page], t % page].view(torch.int16)
        assert torch.equal(got, want)
        assert g.client.list() == []  # consumed by the one decode rank
        if ring:
            assert all(r["used"] == 0 for r in g.client.stat().rings)  # scratch given back


@CUDA
@pytest.mark.gpu
def test_cuda_publish_is_claimed_by_the_host_path_and_back(daemon):
    from kvbroker import kv

    L, H, page, tokens = 3, 4, 16, 40
    cache = _paged(L, H, page=page)
    table = torch.tensor([5, 2, 9], device="cuda")
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        gpu.publish_shard_cuda(
            g, "x", cache, table, tokens, tp_rank=0, tp_size=1, total_kv_heads=H, decode_tp_size=2
        )
        host = torch.zeros((L, 8, page, 2, H // 2, 32), dtype=torch.bfloat16)  # rank 1 of D=2
        hc = kv.PagedKV(host, ("layer", "block", "token", "kv", "head", "head_dim"))
        kv.claim_shards(
            g.client, "x", hc, [1, 0, 3], tp_rank=1, tp_size=2, prefill_tp_size=1, total_kv_heads=H
        )
        t = torch.arange(tokens)
        want = cache.view(torch.int16).cpu()[:, :, table.cpu()[t // page], t % page, 2:4]
        ids = torch.tensor([1, 0, 3])
        got = host.view(torch.int16)[:, ids[t // page], t % page]
        assert torch.equal(got.permute(0, 2, 1, 3, 4), want)
        # and the host path's object claimed by the CUDA path
        kv.publish_shard(
            g.client,
            "y",
            hc,
            [1, 0, 3],
            tokens,
            tp_rank=0,
            tp_size=1,
            total_kv_heads=H // 2,
            decode_tp_size=1,
        )
        back = torch.zeros((L, 2, 8, page, H // 2, 32), dtype=torch.bfloat16, device="cuda")
        gpu.claim_shards_cuda(
            g,
            "y",
            back,
            torch.tensor([7, 6, 5], device="cuda"),
            tp_rank=0,
            tp_size=1,
            prefill_tp_size=1,
            total_kv_heads=H // 2,
        )
        got = back.view(torch.int16).cpu()[:, :, torch.tensor([7, 6, 5])[t // page], t % page]
        assert torch.equal(got, want)
