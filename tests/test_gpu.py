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
    code = "import sys, kvbroker, kvbroker.gpu, kvbroker._kernels; print('torch' in sys.modules)"
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
            "k": torch.randint(-(2**15), 2**15, (4, 1024, 64), dtype=torch.int16,
                               device="cuda").view(torch.bfloat16),  # NaN payloads included
            "v": torch.randn(333, device="cuda", dtype=torch.float32),
        }  # fmt: skip
        assert g.publish("req", src)
        assert not g.publish("req", src)  # exists: nothing copied
        out = {n: torch.empty_like(t) for n, t in src.items()}
        g.claim("req", out, consume=True)
        for n in src:
            assert torch.equal(out[n].view(torch.uint8), src[n].view(torch.uint8))
        assert not g.client.exists("req")


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
