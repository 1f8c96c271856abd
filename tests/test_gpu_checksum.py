"""GPU checksums (kvbroker._client.gpu_checksum) against the CPU definition, bit for bit.

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` (set for this module before Triton
is first imported) when Triton is importable; the torch fallback is always tested. CUDA cases
skip cleanly without a GPU. The CPU reference is python-xxhash itself (per chunk) and
:func:`kvbroker._wire.checksum.digest`.
"""

from __future__ import annotations

import os

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvbroker._client import gpu_checksum as G  # noqa: E402
from kvbroker._wire import checksum as cs  # noqa: E402
from kvbroker.errors import KVBrokerError  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_TRITON_ON_CPU = G.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not _TRITON_ON_CPU,
            reason="Triton is not installed"
            if not G.triton_available()
            else "CPU tensors need TRITON_INTERPRET=1 for Triton (CUDA hosts test it on the GPU)",
        ),
    ),
]


def _bytes(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


@pytest.fixture
def small_chunks():
    """A 4 KiB chunk (4 KiB blocks of xxh3: one loop iteration of GROUP=4 per chunk) so that
    the interpreter gets through many chunks; the definition reads CHUNK at call time."""
    old = cs.CHUNK
    cs.CHUNK = 4096
    yield 4096
    cs.CHUNK = old


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_kernel_equals_xxh3_on_every_length_shape(backend):
    """Lengths cover no whole block, whole blocks with 0..3 left over after the groups of 4,
    partial last blocks of 0..15 stripes, and tails that are not a multiple of 8."""
    buf = _bytes(20_000, 1)
    lengths = [
        241,
        255,
        256,
        1023,
        1024,
        1025,
        1088,
        2047,
        2048,
        3073,
        4096,
        4097,
        5119,
        5120 + 7,
        8 * 1024,
        8 * 1024 + 65,
        9 * 1024 + 1000,
        12_345,
    ]
    starts = [(i * 136) % 4000 for i in range(len(lengths))]  # 8-aligned, overlapping
    got = G.segment_digests(buf, starts, lengths, backend=backend)
    raw = buf.numpy().tobytes()
    want = [xxhash.xxh3_64_intdigest(raw[a : a + n]) for a, n in zip(starts, lengths, strict=True)]
    assert got.tolist() == want


# the fixture only sets a constant, the same for every example
@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 3 * 4096 + 300), min_size=1, max_size=4),
    offset=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from([b if isinstance(b, str) else b.values[0] for b in BACKENDS]),
)
def test_checksums_equal_the_cpu_definition(small_chunks, sizes, offset, seed, backend):
    if backend == "triton" and not _TRITON_ON_CPU:
        return
    base = _bytes(sum(sizes) + offset + 16, seed)
    tensors, at = [], offset  # views at any byte offset: misaligned ones are copied first
    for n in sizes:
        tensors.append(base[at : at + n])
        at += n
    want = [cs.digest(t.numpy().tobytes()) for t in tensors]
    assert G.checksums(tensors, backend=backend) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_tails_and_dtypes(small_chunks, backend):
    """Tails of 1..240 bytes go to the host; every dtype's bytes are hashed as they lie (NaN
    and infinity bit patterns included)."""
    raw = _bytes(3 * 4096 + 240, 7)
    cases = [
        raw[: 4096 + 1],
        raw[: 2 * 4096 + 240],
        raw[:240],
        raw[:0],
        raw[: 4096 + 241],
        raw[: 3 * 4096 + 240].view(torch.bfloat16),
        raw[: 2 * 4096].view(torch.float32),
        raw[: 4096 + 64].view(torch.int64).reshape(2, -1),
    ]
    want = [
        cs.digest(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        for t in cases
    ]
    assert G.checksums(cases, backend=backend) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_chunk_size(backend):
    """Two buffers at the shipped CHUNK: a whole chunk plus a long tail, a whole chunk plus a
    short one (the interpreter takes a few seconds per MiB)."""
    a = _bytes(cs.CHUNK + 1001, 3)
    b = _bytes(cs.CHUNK + 17, 4)
    assert G.checksums([a, b], backend=backend) == [cs.digest(a.numpy()), cs.digest(b.numpy())]


def test_refuses_strided_tensors_and_unknown_backends():
    x = torch.zeros(64, 64, dtype=torch.uint8)
    with pytest.raises(KVBrokerError, match="non-contiguous"):
        G.checksum(x.t())
    with pytest.raises(KVBrokerError, match="unknown backend"):
        G.checksum(x, backend="cuda-magic")
    with pytest.raises(KVBrokerError, match="segments"):
        G.segment_digests(x, [0], [240])
    with pytest.raises(KVBrokerError, match="aligned"):
        G.segment_digests(x, [4], [300])
    assert G.checksums([]) == []


@CUDA
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_equals_cpu(backend):
    sizes = [0, 1, 240, 241, 4099, cs.CHUNK, cs.CHUNK + 7, 3 * cs.CHUNK + 241, 9 * cs.CHUNK + 5]
    host = [_bytes(n, n) for n in sizes]
    dev = [h.cuda() for h in host]
    assert G.checksums(dev, backend=backend) == [cs.digest(h.numpy()) for h in host]
    odd = dev[-1][3:]  # misaligned view
    assert G.checksum(odd, backend=backend) == cs.digest(host[-1].numpy()[3:])


@CUDA
def test_cuda_start_on_a_side_stream_overlaps_a_copy():
    x = _bytes(64 << 20, 11, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    pending = G.start([x], stream=side)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)  # the current stream's DMA, beside the kernel
    torch.cuda.synchronize()
    assert pending.result() == [cs.digest(host.numpy())]


@CUDA
@pytest.mark.parametrize(
    "row_bytes",
    [cs.CHUNK, 2 * cs.CHUNK + 64, 3 * cs.CHUNK + cs.SHORT_MAX + 8, cs.CHUNK // 2 + 8, 2048],
)
def test_start_rows_equals_the_definition_per_row(row_bytes):
    """start_rows (the vLLM save's batch of staged blocks): each row's value is the CPU
    definition's, whether the rows end on a chunk boundary, in a long last chunk or in a
    short one hashed on the host; a misaligned view goes the per-tensor way, same values."""
    rows = 5
    t = _bytes(rows * row_bytes, row_bytes, "cuda").view(rows, row_bytes)
    want = [cs.digest(t[j].cpu().numpy()) for j in range(rows)]
    assert G.start_rows(t).result() == want
    assert G.start_rows(t.view(torch.int16)).result() == want  # any dtype: its bytes
    odd = _bytes(rows * row_bytes + 1, 7, "cuda")[1:].view(rows, row_bytes)
    assert G.start_rows(odd).result() == [cs.digest(odd[j].cpu().numpy()) for j in range(rows)]
