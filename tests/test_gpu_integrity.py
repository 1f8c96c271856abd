"""Integrity on the GPU path: what GpuClient.publish / publish_shard_cuda record at seal, and
what GpuClient.claim(verify=True) checks.

The logic (kvbroker._client.gpu_integrity: which buffers are hashed where, in which kind,
which names a mismatch reports) runs here on CPU tensors (the torch fallback, and the Triton
kernel under ``TRITON_INTERPRET=1`` when Triton is installed), against the CPU definition.
The GpuClient cases need CUDA and skip cleanly without it; benchmarks/run_integrity_gpu.sh runs
them on the GPU host. Corruption is made as in tests/test_integrity.py: through a second
mapping of the pool, behind the broker's back.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvbroker import ChecksumMismatch  # noqa: E402
from kvbroker._client import gpu_checksum as G  # noqa: E402
from kvbroker._client import gpu_integrity as GI  # noqa: E402
from kvbroker._wire import checksum as cs  # noqa: E402

from test_integrity import corrupt  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_TRITON_ON_CPU = G.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not _TRITON_ON_CPU, reason="Triton on CPU tensors needs Triton and TRITON_INTERPRET=1"
        ),
    ),
]


@pytest.fixture
def small_chunks():
    """4 KiB chunks, so that the interpreter gets through several per buffer (the definition
    and the kernel's plan read CHUNK at call time)."""
    old = cs.CHUNK
    cs.CHUNK = 4096
    yield 4096
    cs.CHUNK = old


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(G, "select_backend", lambda *t: request.param)
    return request.param


def _bytes(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


class _Streams:
    """A stream_for that records which devices it was asked for."""

    def __init__(self):
        self.asked = []

    def __call__(self, device):
        self.asked.append(device)
        return None


def _raw(t):
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


# -- the logic, on CPU tensors ------------------------------------------------------------------
def test_seal_kind_1_hashes_every_tensor_where_it_lies(small_chunks, backend):
    """Sizes: several chunks with a long tail, a short (host-hashed) tail, one chunk, empty;
    dtypes as they lie; a misaligned view. One start per device, values named as given."""
    raw = _bytes(3 * 4096 + 300, 1)
    tensors = {
        "k.0": raw[: 3 * 4096 + 250],
        "v.0": raw[: 2 * 4096 + 100],
        "k.1": raw[:4096].view(torch.bfloat16),
        "empty": raw[:0],
        "odd": raw[5 : 5 + 4096 + 400],
    }
    streams = _Streams()
    sums = GI.start_seal(tensors, cs.KIND_XXH3C, streams)
    assert streams.asked == [torch.device("cpu")]  # one launch for the device's tensors
    got = sums.values({})  # kind 1 never reads the pool's bytes
    assert list(got) == list(tensors)
    assert got == {n: [1, cs.digest(_raw(t))] for n, t in tensors.items()}


def test_seal_kind_0_hashes_the_pool_bytes_after_the_copy(small_chunks):
    """Against a daemon that takes kind 0 only: nothing is started on the device, and the
    values are the whole-buffer xxh3_64 of the bytes in the pool (not of the sources: a copy
    that went wrong is then caught by a claimer's verify, not sealed as good)."""
    tensors = {"a": _bytes(5000, 2), "b": _bytes(0, 3)}
    streams = _Streams()
    sums = GI.start_seal(tensors, cs.KIND_XXH3, streams)
    assert streams.asked == []
    pool = {"a": np.full(5000, 9, dtype=np.uint8), "b": np.zeros(0, dtype=np.uint8)}
    assert sums.values(pool) == {
        "a": xxhash.xxh3_64_intdigest(bytes([9]) * 5000),
        "b": xxhash.xxh3_64_intdigest(b""),
    }
    with pytest.raises(ValueError, match="unknown checksum kind"):
        GI.start_seal(tensors, 7, streams)


def test_verify_checks_each_buffer_in_the_kind_it_was_sealed_with(small_chunks, backend):
    """Kind-1 buffers are recomputed from the claimed tensors, kind-0 ones from the pool's
    bytes; buffers without a recorded checksum are skipped; the names reported are exactly
    the corrupted ones."""
    data = {n: _bytes(2 * 4096 + 77 * i, 10 + i) for i, n in enumerate("abcde")}
    pool = {n: t.numpy().copy() for n, t in data.items()}
    recorded = {
        "a": [1, cs.digest(pool["a"])],
        "b": [1, cs.digest(pool["b"])],
        "c": xxhash.xxh3_64_intdigest(pool["c"]),
        "d": xxhash.xxh3_64_intdigest(pool["d"]),
    }  # ("e": sealed without)
    claimed = {n: t.clone() for n, t in data.items()}

    def check():
        return GI.mismatched(GI.start_verify(claimed, recorded, _Streams()).values(pool), recorded)

    assert check() == []
    claimed["b"][4096 + 3] ^= 1  # in transit, or in the pool before the copy: kind 1 sees it
    claimed["e"][0] ^= 1  # unchecked: nobody can tell
    pool["d"][77] ^= 0x40  # kind 0: hashed from the pool
    claimed["c"][5] ^= 1  # kind 0 does not read the tensors
    assert check() == ["b", "d"]
    assert GI.start_verify(claimed, None, _Streams()).values(pool) == {}


def test_verify_asks_one_stream_per_device_and_only_for_kind_1(small_chunks):
    t = {"a": _bytes(300, 1), "b": _bytes(300, 2)}
    legacy = {n: xxhash.xxh3_64_intdigest(_raw(x)) for n, x in t.items()}
    streams = _Streams()
    GI.start_verify(t, legacy, streams).values({n: x.numpy() for n, x in t.items()})
    assert streams.asked == []
    GI.start_verify(t, {n: [1, cs.digest(_raw(x))] for n, x in t.items()}, streams).wait()
    assert streams.asked == [torch.device("cpu")]


# -- GpuClient, with CUDA --------------------------------------------------------------------
def _gpu():
    from kvbroker import gpu

    return gpu


def _tensors():
    return {
        "k": torch.randint(-(2**15), 2**15, (4, 1024, 300), dtype=torch.int16, device="cuda").view(
            torch.bfloat16
        ),  # 2.3 MiB: chunks and a tail
        "v": torch.randn(333, device="cuda", dtype=torch.float32),
        "tail": _bytes(cs.CHUNK + 100, 5, "cuda"),  # a short last chunk (host-hashed)
        "empty": torch.empty(0, device="cuda"),
    }


@CUDA
@pytest.mark.gpu
def test_gpu_publish_records_kind_1_by_default_and_every_path_verifies(daemon):
    gpu = _gpu()
    src = _tensors()
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        assert g.publish("req", src)
        sums = g.client.lookup("req").checksums
        assert sums == {n: [1, cs.digest(_raw(t.cpu()))] for n, t in src.items()}
        out = {n: torch.empty_like(t) for n, t in src.items()}
        g.claim("req", out, verify=True)
        for n in src:
            assert torch.equal(out[n].view(torch.uint8), src[n].view(torch.uint8))
        g.client.claim("req", verify=True).release()  # the host path accepts the same sums
        g.client.get("req", verify=True)
        assert g.publish("plain", {"x": src["v"]}, checksum=False)
        assert g.client.lookup("plain").checksums is None
        g.claim("plain", {"x": torch.empty_like(src["v"])}, verify=True)  # nothing to check


@CUDA
@pytest.mark.gpu
def test_gpu_publish_hashes_what_the_producer_stream_wrote(daemon):
    """The checksum kernel runs on its own stream: it must wait for the caller's stream as
    the DMA does (a misaligned view included: its aligned copy is made on that stream)."""
    gpu = _gpu()
    producer = torch.cuda.Stream()
    base = torch.zeros((1 << 22) + 16, dtype=torch.uint8, device="cuda")
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(50_000_000)  # the "forward pass" is still running
            base.fill_(7)
        odd = base[3 : 3 + (1 << 22)]
        assert g.publish("late", {"x": base, "odd": odd}, stream=producer)
        assert g.client.lookup("late").checksums == {
            "x": [1, cs.digest(bytes([7]) * base.numel())],
            "odd": [1, cs.digest(bytes([7]) * odd.numel())],
        }


@CUDA
@pytest.mark.gpu
def test_gpu_claim_verify_flags_a_corrupted_pool_byte(daemon):
    gpu = _gpu()
    src = _tensors()
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        assert g.publish("req", src)
        corrupt(g.client, "req", "tail", at=cs.CHUNK + 50)
        out = {n: torch.empty_like(t) for n, t in src.items()}
        with pytest.raises(ChecksumMismatch) as err:
            g.claim("req", out, verify=True)
        assert err.value.buffers == ("tail",)
        assert g.client.stat().read_leases == 0  # released
        # without verify the bad byte would have been handed over unflagged
        g.claim("req", out)
        assert not torch.equal(out["tail"], src["tail"])
        # a claim of the intact buffers only verifies
        g.claim("req", {"k": out["k"], "v": out["v"]}, verify=True)


@CUDA
@pytest.mark.gpu
def test_gpu_claim_verify_hashes_each_group_as_it_lands(daemon, monkeypatch):
    """verify hashes group after group while the next groups copy: a bad byte in any
    group, kind 1 or kind 0 alike, is caught, and the bytes of every group are all there."""
    from kvbroker._client import gpu_client

    gpu = _gpu()
    monkeypatch.setattr(gpu_client, "VERIFY_GROUP_BYTES", cs.CHUNK)  # a group per buffer
    rng = np.random.default_rng(11)
    src = {
        f"b{i}": torch.from_numpy(rng.integers(0, 256, cs.CHUNK + 7 * i, dtype=np.uint8)).cuda()
        for i in range(6)
    }
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        assert g.publish("req", src)
        out = {n: torch.empty_like(t) for n, t in src.items()}
        g.claim("req", out, verify=True)
        assert all(torch.equal(out[n], src[n]) for n in src)
        assert g.last_copies == len(src)  # one copy per group, none merged across groups
        corrupt(g.client, "req", "b3", at=5)
        with pytest.raises(ChecksumMismatch) as err:
            g.claim("req", out, verify=True)
        assert err.value.buffers == ("b3",)
        assert g.client.stat().read_leases == 0


def test_verify_groups_cut_by_bytes_in_order():
    from kvbroker._client.gpu_client import VERIFY_GROUP_BYTES, _verify_groups

    g = VERIFY_GROUP_BYTES
    flat = {"a": (0, g // 2), "b": (0, g // 2), "c": (0, 3 * g), "d": (0, 1), "e": (0, 1)}
    assert _verify_groups(flat) == [["a", "b"], ["c"], ["d", "e"]]
    assert _verify_groups({}) == [[]]
    assert _verify_groups({"x": (0, 0)}) == [["x"]]


@CUDA
@pytest.mark.gpu
def test_gpu_claim_verifies_kind_0_objects_from_the_pool(daemon):
    gpu = _gpu()
    data = np.random.default_rng(3).integers(0, 256, 2 * cs.CHUNK + 99, dtype=np.uint8)
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        lease = g.client.reserve("old", {"a": data.nbytes, "b": 5})
        lease["a"][:] = data
        lease["b"][:] = np.frombuffer(b"small", dtype=np.uint8)
        lease.checksums = {
            "a": xxhash.xxh3_64_intdigest(data),
            "b": xxhash.xxh3_64_intdigest(b"small"),
        }
        lease.seal()
        out = {
            "a": torch.empty(data.nbytes, dtype=torch.uint8, device="cuda"),
            "b": torch.empty(5, dtype=torch.uint8, device="cuda"),
        }
        g.claim("old", out, verify=True)
        assert bytes(out["a"].cpu().numpy()) == data.tobytes()
        corrupt(g.client, "old", "a", at=cs.CHUNK + 5)
        with pytest.raises(ChecksumMismatch) as err:
            g.claim("old", out, verify=True)
        assert err.value.buffers == ("a",)


@CUDA
@pytest.mark.gpu
def test_gpu_publish_seals_kind_0_for_a_daemon_without_kind_1(daemon):
    gpu = _gpu()
    src = _tensors()
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        g.client.checksum_kind = cs.KIND_XXH3  # what a hello without kind 1 makes it
        assert g.publish("req", src)
        assert g.client.lookup("req").checksums == {
            n: xxhash.xxh3_64_intdigest(_raw(t.cpu())) for n, t in src.items()
        }
        g.claim("req", {n: torch.empty_like(t) for n, t in src.items()}, verify=True)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("kind", [cs.KIND_XXH3C, cs.KIND_XXH3])
def test_publish_shard_cuda_records_the_staged_buffers_checksums(kind, make_daemon):
    gpu = _gpu()
    d = make_daemon("--pool-size", "256M", "--page-size", "64K", "--gpu-ring", "64M")
    L, H, page, tokens = 3, 4, 16, 1000
    cache = torch.randint(
        -(2**15), 2**15, (L, 2, 80, page, H, 64), dtype=torch.int16, device="cuda"
    ).view(torch.bfloat16)
    table = torch.randperm(80, device="cuda")[: -(-tokens // page)]
    with gpu.GpuClient(d.client(), own_client=True) as g:
        g.client.checksum_kind = kind
        res = gpu.publish_shard_cuda(
            g, "r", cache, table, tokens, tp_rank=0, tp_size=1, total_kv_heads=H, decode_tp_size=1
        )
        key = res.key
        with g.client.claim(key) as lease:
            want = {
                n: ([1, cs.digest(lease[n])] if kind else xxhash.xxh3_64_intdigest(lease[n]))
                for n in lease
            }
            assert lease.checksums == want and len(want) == 2 * L
        g.client.claim(key, verify=True).release()
        assert all(r["used"] == 0 for r in g.client.stat().rings)  # the staging went back
        bad = sorted(want)[1]
        corrupt(g.client, key, bad, at=100)
        with pytest.raises(ChecksumMismatch) as err:
            g.client.claim(key, verify=True)
        assert err.value.buffers == (bad,)


@CUDA
@pytest.mark.gpu
def test_start_checksums_for_a_lease_filled_by_the_caller(daemon):
    """What an integration that copies into a reserve() lease itself calls (transformers'
    publish_cache, a connector's save): the sums recorded are the CPU definition's."""
    gpu = _gpu()
    src = _tensors()
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        lease = g.client.reserve("own", {n: t.nbytes for n, t in src.items()})
        sums = g.start_checksums(src)
        for n, t in src.items():
            if t.nbytes:
                gpu.host_tensors(lease)[n].copy_(t.view(-1).view(torch.uint8))
        lease.checksums = sums.values(lease)
        lease.seal()
        assert g.client.lookup("own").checksums == {
            n: [1, cs.digest(_raw(t.cpu()))] for n, t in src.items()
        }
        g.client.checksum_kind = cs.KIND_XXH3
        lease = g.client.reserve("own0", {"a": src["k"].nbytes})
        sums = g.start_checksums({"a": src["k"]})
        gpu.host_tensors(lease)["a"].copy_(src["k"].view(-1).view(torch.uint8))
        lease.checksums = sums.values(lease)
        lease.seal()
        want0 = xxhash.xxh3_64_intdigest(_raw(src["k"].cpu()))
        assert g.client.lookup("own0").checksums == {"a": want0}


@CUDA
@pytest.mark.gpu
def test_transformers_publish_cache_through_a_gpu_client_seals_gpu_checksums(daemon):
    """publish_cache given a GpuClient and CUDA layers: DMA + kind-1 checksums computed on the
    GPU (GpuClient.publish), the values the CPU's definition gives, and verify agrees."""
    from kvbroker._client.integrity import verify_objects
    from kvbroker.errors import Exists
    from kvbroker.integrations.transformers import publish_cache

    gpu = _gpu()
    g0 = torch.Generator(device="cuda").manual_seed(3)
    layers = [
        (
            torch.randn(1, 2, 40, 32, device="cuda", generator=g0, dtype=torch.bfloat16),
            torch.randn(1, 2, 40, 32, device="cuda", generator=g0, dtype=torch.bfloat16)
            .transpose(2, 3)
            .contiguous()
            .transpose(2, 3),
        )  # strided V, as some caches hold
        for _ in range(3)
    ]
    with gpu.GpuClient(daemon.client(), own_client=True) as g:
        publish_cache(g, "tf-gpu", layers)
        info = g.client.lookup("tf-gpu")
        assert info.checksums and all(v[0] == cs.KIND_XXH3C for v in info.checksums.values())
        k0 = layers[0][0].contiguous().cpu()
        assert info.checksums["past_key.0"] == [1, cs.digest(_raw(k0))]
        with pytest.raises(Exists):
            publish_cache(g, "tf-gpu", layers)
    with daemon.client() as c:
        assert [v.status for v in verify_objects(c, match="tf-gpu")] == ["ok"]
