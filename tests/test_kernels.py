"""Gather/scatter kernels against a per-token loop reference, on fresh random data.

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` (set for this module before Triton
is first imported) when Triton is importable; the torch fallback is always tested. CUDA tests
skip cleanly without a GPU.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvbroker._client import kernels as _kernels
from kvbroker.errors import KVBrokerError  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# CPU tensors: Triton runs them only under the interpreter (CUDA hosts test it on the GPU below).
# Without Triton its cases show as skipped, with the reason, instead of vanishing.
_TRITON_ON_CPU = _kernels.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not _TRITON_ON_CPU,
            reason="Triton is not installed"
            if not _kernels.triton_available()
            else "CPU tensors need TRITON_INTERPRET=1 for Triton (CUDA hosts test it on the GPU)",
        ),
    ),
]

# (layers, kv, blocks, page, heads, head_dim, dtype, tokens, head_start, nheads)
SHAPES = [
    (2, 2, 8, 4, 4, 8, torch.bfloat16, 13, 1, 2),
    (3, 2, 6, 16, 2, 16, torch.float16, 32, 0, 2),  # whole pages, all heads
    (1, 1, 5, 8, 3, 6, torch.float32, 17, 2, 1),  # MLA-like: kv axis of 1; odd head_dim
    (2, 2, 4, 2, 8, 4, torch.uint8, 7, 4, 4),  # fp8 stand-in: one-byte items
]


def _random(shape, dtype, gen, device="cpu"):
    """Random bit patterns (NaNs and infinities included for float dtypes)."""
    n = 1
    for x in shape:
        n *= x
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def _table(blocks, tokens, page, gen):
    need = -(-tokens // page)
    return torch.randperm(blocks, generator=gen)[:need].to(torch.int32)


def _ref_gather(cache, table, tokens, h0, nh):
    L, C, _, page, _, D = cache.shape
    out = torch.empty((L, C, nh, tokens, D), dtype=cache.dtype)
    for t in range(tokens):
        b, s = int(table[t // page]), t % page
        out[:, :, :, t] = cache[:, :, b, s, h0 : h0 + nh].cpu()
    return out


def _bits(x):
    return (
        x.cpu().view(torch.uint8)
        if x.element_size() == 1
        else x.cpu().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + str(s[6])[6:])
def test_gather_matches_reference(backend, shape):
    L, C, B, P, H, D, dtype, T, h0, nh = shape
    gen = torch.Generator().manual_seed(sum(shape[:6]) * 31 + len(backend))
    cache = _random((L, C, B, P, H, D), dtype, gen)
    if dtype.is_floating_point:  # NaN payloads must survive: bytes, not float values, move
        cache.view(-1)[0:1].view(torch.uint8)[:] = 0xFF
    table = _table(B, T, P, gen)
    staging = torch.zeros((L, C, nh, T, D), dtype=dtype)
    before = cache.clone()
    _kernels.gather(cache, table, T, staging, head_start=h0, backend=backend)
    assert torch.equal(_bits(staging), _bits(_ref_gather(cache, table, T, h0, nh)))
    assert torch.equal(_bits(cache), _bits(before))  # gather only reads the cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + str(s[6])[6:])
def test_scatter_writes_only_its_heads_and_blocks(backend, shape):
    L, C, B, P, H, D, dtype, T, h0, nh = shape
    gen = torch.Generator().manual_seed(7 + sum(shape[:6]))
    staging = _random((L, C, nh, T, D), dtype, gen)
    cache = _random((L, C, B, P, H, D), dtype, gen)
    table = _table(B, T, P, gen)
    expect = cache.clone()
    for t in range(T):
        expect[:, :, int(table[t // P]), t % P, h0 : h0 + nh] = staging[:, :, :, t]
    _kernels.scatter(staging, cache, table, T, head_start=h0, backend=backend)
    assert torch.equal(_bits(cache), _bits(expect))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_through_permuted_cache_and_narrowed_staging(backend):
    # a cache stored [L, 2, blocks, heads, page, D] is passed permuted; the staging is a head
    # slice of a larger region (a heterogeneous-TP claim of part of a shard)
    gen = torch.Generator().manual_seed(11)
    L, C, B, P, H, D, T = 2, 2, 6, 4, 4, 8, 10
    stored = _random((L, C, B, H, P, D), torch.bfloat16, gen)
    cache = stored.permute(0, 1, 2, 4, 3, 5)
    table = _table(B, T, P, gen)
    big = torch.zeros((L, C, 6, T, D), dtype=torch.bfloat16)
    region = big[:, :, 2:5]
    _kernels.gather(cache, table, T, region, head_start=1, backend=backend)
    assert torch.equal(_bits(region), _bits(_ref_gather(cache, table, T, 1, 3)))
    assert not _bits(big[:, :, :2]).any() and not _bits(big[:, :, 5:]).any()
    dst_stored = torch.zeros((L, C, B, H, P, D), dtype=torch.bfloat16)
    dst = dst_stored.permute(0, 1, 2, 4, 3, 5)
    table2 = _table(B, T, P, gen)
    _kernels.scatter(region, dst, table2, T, head_start=0, backend=backend)
    assert torch.equal(_bits(_ref_gather(dst, table2, T, 0, 3)), _bits(region))
    assert not _bits(dst[..., 3:, :]).any()


def test_bad_shapes_fail_clearly():
    cache = torch.zeros((2, 2, 4, 4, 4, 8), dtype=torch.float16)
    table = torch.arange(4, dtype=torch.int32)
    with pytest.raises(KVBrokerError, match="heads"):
        _kernels.gather(
            cache, table, 8, torch.zeros((2, 2, 2, 8, 8), dtype=torch.float16), head_start=3
        )
    with pytest.raises(KVBrokerError, match="dtype"):
        _kernels.gather(cache, table, 8, torch.zeros((2, 2, 2, 8, 8), dtype=torch.bfloat16))
    with pytest.raises(KVBrokerError, match="block ids"):
        _kernels.gather(cache, table[:1], 8, torch.zeros((2, 2, 2, 8, 8), dtype=torch.float16))
    with pytest.raises(KVBrokerError, match="6 axes"):
        _kernels.gather(cache[0], table, 8, torch.zeros((2, 2, 2, 8, 8), dtype=torch.float16))


def test_backend_is_torch_for_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _kernels.select_backend(torch.zeros(1)) == "torch"


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + str(s[6])[6:])
def test_cuda_kernels_match_reference(shape):
    L, C, B, P, H, D, dtype, T, h0, nh = shape
    gen = torch.Generator().manual_seed(3)
    cache = _random((L, C, B, P, H, D), dtype, gen, "cuda")
    table = _table(B, T, P, gen).cuda()
    staging = torch.zeros((L, C, nh, T, D), dtype=dtype, device="cuda")
    assert _kernels.select_backend(cache, staging) == (
        "triton" if _kernels.triton_available() else "torch"
    )
    _kernels.gather(cache, table, T, staging, head_start=h0)
    assert torch.equal(_bits(staging), _bits(_ref_gather(cache.cpu(), table.cpu(), T, h0, nh)))
    dst = torch.zeros_like(cache)
    _kernels.scatter(staging, dst, table, T, head_start=h0)
    assert torch.equal(_bits(_ref_gather(dst.cpu(), table.cpu(), T, h0, nh)), _bits(staging))
