"""The vLLM connector's worker-side data path with caches shaped like vLLM 0.32's, without
vLLM: ``kvbroker.integrations.vllm._paged`` (host) and ``._cuda`` (device staging + DMA).

vLLM allocates every layer of a cache group in one buffer and views it per layer as
``[blocks, kv_heads, block_size, 2*head_dim]`` with the stride order of the cache layout:
NHD (``LBNHC``, physical ``[layer][block][token][head][K|V]``) or HND (``LBHNC``, physical
``[layer][block][head][token][K|V]``); the CPU backend reads the latter's block as all K rows
then all V rows. The CUDA tests (NHD and HND, bf16) skip without CUDA; the same staging code
runs on CPU tensors here with a memmove standing in for the DMA, so its addressing, chunking
and resharding are checked on every machine.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.integrations.vllm._format import BlockFormat
from kvbroker.integrations.vllm._paged import HostSave, SaveItem, cuda_cache, host_cache, load_host

CUDA = torch.cuda.is_available()
NS = "vllm/test-0000"


def vllm_like(layers, blocks, heads, page, dim, dtype, device, order="NHD", seed=0):
    """Per-layer views ``[blocks, heads, page, 2*dim]`` of one allocation, like vLLM's."""
    g = torch.Generator().manual_seed(seed)
    c = 2 * dim
    raw = (
        torch.randint(
            -30000, 30000, (layers * blocks * heads * page * c,), generator=g, dtype=torch.int16
        )
        .view(torch.bfloat16)
        .to(dtype)
    )
    raw = raw.to(device)
    if order == "NHD":  # physical [L][B][N][H][C]
        strides = (blocks * page * heads * c, page * heads * c, c, heads * c, 1)
    else:  # HND: physical [L][B][H][N][C]
        strides = (blocks * heads * page * c, heads * page * c, page * c, c, 1)
    five = torch.as_strided(raw, (layers, blocks, heads, page, c), strides)
    return [five[i] for i in range(layers)], raw


def _fmt(layers, heads, page, dim, dtype, tp_rank=0, tp_size=1, total=None):
    total = total or heads * tp_size
    return BlockFormat(
        dtype=str(dtype).removeprefix("torch."),
        num_layers=layers,
        block_size=page,
        head_dim=dim,
        local_heads=heads,
        total_kv_heads=total,
        tp_rank=tp_rank,
        tp_size=tp_size,
        heads=(tp_rank * heads, (tp_rank + 1) * heads),
    )


def _items(hashes, ids):
    return [
        SaveItem(h, hashes[i - 1] if i else None, b)
        for i, (h, b) in enumerate(zip(hashes, ids, strict=True))
    ]


def _host_block(layer_cache, block):
    """Block ``block`` of one layer of a CPU-backend cache (``vllm_like(..., "HND")``: each
    (block, head) holds its K rows, then its V rows) as ``[K/V, token, head, dim]``, the
    order of a packed block."""
    blocks, heads, page, c = layer_cache.shape
    return layer_cache.view(blocks, heads, 2, page, c // 2)[block].permute(1, 2, 0, 3)


def _bits(t):
    """The bytes as integers: NaN payloads compare too."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


HASHES = [f"{i:032x}" for i in range(1, 7)]


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_staging_path_round_trips_bit_exact_on_cpu_tensors(client, order):
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 3, 12, 2, 16, 32
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", order)
    dst, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", order, seed=1)
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6, d6 = cuda_cache(src, "packed"), cuda_cache(dst, "packed")
    src_ids, dst_ids = [7, 2, 9, 0, 4, 11], [1, 3, 5, 6, 8, 10]
    memmove = copier_for("cpu")
    # a staging budget of two blocks: two halves of one block, six chunks each way
    new, old = save_cuda(
        client,
        NS,
        fmt,
        s6,
        _items(HASHES, src_ids),
        copier=memmove,
        staging_bytes=2 * fmt.block_nbytes,
    )
    assert (new, old) == (6, 0)
    assert save_cuda(client, NS, fmt, s6, _items(HASHES, src_ids), copier=memmove) == (0, 6)
    got = load_cuda(
        client, NS, fmt, d6, HASHES, dst_ids, copier=memmove, staging_bytes=2 * fmt.block_nbytes
    )
    assert got == 6
    for a, b in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(_bits(s6[:, :, a]), _bits(d6[:, :, b]))
    untouched = [i for i in range(B) if i not in dst_ids]
    ref, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", order, seed=1)
    r6 = cuda_cache(ref, "packed")
    assert torch.equal(_bits(d6[:, :, untouched]), _bits(r6[:, :, untouched]))


def test_a_save_failing_mid_way_seals_whole_chunks_and_aborts_the_rest(client):
    """The pipelined save queues every chunk's reservation at once and seals a chunk once its
    copy ended; a copy that fails aborts every block not sealed yet, the reservations still
    queued included: nothing half-written is left leased or visible."""
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 8, 1, 16, 32
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    memmove = copier_for("cpu")
    calls = []

    def failing(runs, stream):
        calls.append(len(runs))
        if len(calls) == 3:
            raise OSError("DMA failed")
        return memmove(runs, stream)

    with pytest.raises(OSError, match="DMA failed"):
        save_cuda(
            client,
            NS,
            fmt,
            cuda_cache(src, "packed"),
            _items(HASHES, [0, 1, 2, 3, 4, 5]),
            copier=failing,
            staging_bytes=2 * fmt.block_nbytes,
        )
    published = {o.key for o in client.list(namespace=NS)}
    # chunks 0 and 1 were sealed once their copies ended; chunk 2 (its copy failed) and
    # chunks 3-5 (reserved, queued in the daemon) were aborted
    assert published == {fmt.key(h) for h in HASHES[:2]}
    me = [c for c in client.stat().clients if c.write_leases]
    assert me == []  # the failed chunk's reservation was aborted
    # and the blocks are whole: they load back bit for bit
    from kvbroker.integrations.vllm._cuda import load_cuda

    dst, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", seed=1)
    d6 = cuda_cache(dst, "packed")
    assert load_cuda(client, NS, fmt, d6, HASHES, [6, 7], copier=memmove) == 2
    assert torch.equal(_bits(d6[:, :, 6:8]), _bits(cuda_cache(src, "packed")[:, :, 0:2]))


def test_blocks_of_named_buffers_load_like_packed_ones(client):
    """The connector publishes a block as one packed buffer; blocks of publish_kv's named
    buffers (same bytes, one buffer each) load through both the staging and the host path."""
    from kvbroker.integrations.vllm._cuda import load_cuda
    from kvbroker.integrations.vllm._paged import copier_for
    from kvbroker.prefix import PrefixCache

    L, B, H, N, D = 2, 6, 2, 32, 32
    fmt = _fmt(L, H, N, D, torch.float32)
    cpu_layout, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND", seed=3)
    host = host_cache(cpu_layout, "cpu")
    pc = PrefixCache(client, namespace=NS, block_size=N, tp_rank=0, tp_size=1, total_kv_heads=H)
    tokens = list(range(3 * N + 1))
    assert pc.publish_kv(tokens, host, [1, 2, 3]) == 3
    hashes = pc.hashes(tokens)
    assert "packed" not in client.lookup(fmt.key(hashes[0]), namespace=NS).meta
    packed, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "NHD", seed=4)
    p6 = cuda_cache(packed, "packed")
    assert load_cuda(client, NS, fmt, p6, hashes, [5, 0, 4], copier=copier_for("cpu")) == 3
    for a, b in zip([1, 2, 3], [5, 0, 4], strict=True):
        for layer in range(L):
            assert torch.equal(_bits(_host_block(cpu_layout[layer], a)), _bits(p6[layer, :, b]))


@pytest.mark.parametrize("packed_first", [False, True])
def test_a_prefix_of_named_and_packed_blocks_loads_whole(client, packed_first):
    """One chain of both block forms (a connector upgraded on a node whose daemon kept the
    named blocks of the old one, or publish_kv beside the connector): the match replies a map
    per block, and the staging path reads each in its form, whichever the first is."""
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
    from kvbroker.integrations.vllm._paged import copier_for
    from kvbroker.prefix import PrefixCache

    L, B, H, N, D = 2, 8, 2, 32, 32
    fmt = _fmt(L, H, N, D, torch.float32)
    memmove = copier_for("cpu")
    cpu_layout, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND", seed=3)
    host = host_cache(cpu_layout, "cpu")
    src, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "NHD", seed=4)
    s6 = cuda_cache(src, "packed")
    pc = PrefixCache(client, namespace=NS, block_size=N, tp_rank=0, tp_size=1, total_kv_heads=H)
    tokens = list(range(4 * N + 1))
    hashes = pc.hashes(tokens)
    if packed_first:  # blocks 0-1 packed, 2-3 named
        save_cuda(client, NS, fmt, s6, _items(hashes[:2], [0, 1]), copier=memmove)
        assert pc.publish_kv(tokens, host, [6, 7, 2, 3]) == 2
    else:  # blocks 0-1 named, 2-3 packed
        assert pc.publish_kv(tokens[: 2 * N + 1], host, [0, 1]) == 2
        assert save_cuda(client, NS, fmt, s6, _items(hashes, [6, 7, 2, 3]), copier=memmove) == (
            2,
            2,
        )
    dst, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "NHD", seed=5)
    d6 = cuda_cache(dst, "packed")
    assert load_cuda(client, NS, fmt, d6, hashes, [4, 5, 6, 7], copier=memmove) == 4
    out_layout, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND", seed=6)
    out = host_cache(out_layout, "cpu")
    assert load_host(client, NS, fmt, out, hashes, [4, 5, 6, 7]) == 4  # the host path too
    for j, b in enumerate([4, 5, 6, 7]):
        want = (
            [s6[layer, :, j] for layer in range(L)]
            if (j < 2) == packed_first
            else [_host_block(cpu_layout[layer], j) for layer in range(L)]
        )
        for layer in range(L):  # [K/V, token, head, dim]
            assert torch.equal(_bits(d6[layer, :, b]), _bits(want[layer]))
            assert torch.equal(_bits(_host_block(out_layout[layer], b)), _bits(want[layer]))


def test_a_host_save_whose_seal_is_refused_holds_nothing(make_daemon):
    """The host path's seal refused (a daemon requiring checksums, a save told to seal
    without): its reservations are aborted, not left leased until their TTL, holding pool
    pages, every step."""
    daemon = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_REQUIRE_CHECKSUMS": "true"}
    )
    from kvbroker.errors import BadRequest

    L, B, H, N, D = 2, 8, 2, 16, 32
    layers, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND")
    fmt = _fmt(L, H, N, D, torch.float32)
    with daemon.client() as client:
        save = HostSave(
            client,
            NS,
            fmt,
            host_cache(layers, "cpu"),
            _items(HASHES[:3], [0, 1, 2]),
            checksums=False,
        )
        save.reserve()
        for layer in range(L):
            save.copy_layer(layer)
        with pytest.raises(BadRequest, match="require_checksums"):
            save.seal()
        save.abort()  # what the worker does next: must not be a no-op
        assert [c.write_leases for c in client.stat().clients] == [0]


def test_a_host_save_seals_each_block_with_its_checksum(make_daemon, monkeypatch):
    """The host path seals every block with its checksum, hashed over the copy engine's
    threads: a daemon requiring checksums takes it, and each recorded checksum is the
    block's own (``verify_objects``, the CPU's definition)."""
    from kvbroker._client import engine as _engine
    from kvbroker._client.integrity import verify_objects

    monkeypatch.setattr(_engine, "_default", _engine.CopyEngine(threads=3))
    daemon = make_daemon(
        "--pool-size", "64M", "--page-size", "4K", env={"KVBROKER_REQUIRE_CHECKSUMS": "true"}
    )
    L, B, H, N, D = 4, 24, 4, 16, 128  # 256 KiB blocks, 16 saved: 4 MiB over the threads
    layers, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND")
    fmt = _fmt(L, H, N, D, torch.float32)
    hashes = [f"{i:032x}" for i in range(100, 116)]
    with daemon.client() as client:
        save = HostSave(
            client, NS, fmt, host_cache(layers, "cpu"), _items(hashes, list(range(2, 18)))
        )
        save.reserve()
        for layer in range(L):
            save.copy_layer(layer)
        save.seal()
        checks = list(verify_objects(client, namespace=NS))
        assert len(checks) == 16 and {c.status for c in checks} == {"ok"}
        out, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND", seed=9)
        assert load_host(client, NS, fmt, host_cache(out, "cpu"), hashes, list(range(16))) == 16
        for j in range(16):
            for layer in range(L):
                assert torch.equal(
                    out[layer].view(torch.int32).view(B, H, 2, N, D)[j],
                    layers[layer].view(torch.int32).view(B, H, 2, N, D)[j + 2],
                )


def test_a_long_host_save_seals_a_chunk_of_blocks_per_request(make_daemon, monkeypatch):
    """A save of many blocks seals them RESERVE_CHUNK at a time, as they were reserved: one
    request for all of a long prefill's blocks and their checksums would outgrow a frame."""
    from kvbroker._client.integrity import verify_objects
    from kvbroker import blocks
    from kvbroker.integrations.vllm._paged import RESERVE_CHUNK

    sealed = []
    real = blocks.seal
    monkeypatch.setattr(
        blocks,
        "seal",
        lambda c, leases, sums=None: (
            sealed.append((len(leases), len(sums))),
            real(c, leases, sums),
        )[1],
    )
    daemon = make_daemon("--pool-size", "16M", "--page-size", "4K")
    n = 2 * RESERVE_CHUNK + 44
    L, B, H, N, D = 1, n + 2, 1, 16, 8
    layers, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND")
    fmt = _fmt(L, H, N, D, torch.float32)
    hashes = [f"{i:032x}" for i in range(1000, 1000 + n)]
    with daemon.client() as client:
        save = HostSave(client, NS, fmt, host_cache(layers, "cpu"), _items(hashes, list(range(n))))
        save.reserve()
        save.copy_layer(0)
        save.seal()
        assert sealed == [(RESERVE_CHUNK, RESERVE_CHUNK)] * 2 + [(44, 44)]
        checks = list(verify_objects(client, namespace=NS))
        assert len(checks) == n and {c.status for c in checks} == {"ok"}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pool_runs_move_every_buffer_where_one_copy_per_buffer_would(data):
    """The vectorized run builder against the obvious loop: same bytes end up in the same
    places, whatever the pools, offsets and buffer order."""
    from kvbroker.blocks import pool_runs

    k = data.draw(st.integers(1, 5))
    names = [f"b{i}" for i in range(k)]
    order = data.draw(st.permutations(names))
    nbytes = data.draw(st.sampled_from([8, 64]))
    m = data.draw(st.integers(1, 6))
    back_to_back = data.draw(st.booleans())
    rows, at = [], 0
    for _ in range(m):
        pool = data.draw(st.integers(0, 2))
        if back_to_back:  # the broker's layout, in `names` order
            offs = [at + i * nbytes for i in range(k)]
        else:
            offs = [data.draw(st.integers(0, 1 << 20)) * 8 for _ in range(k)]
        at += k * nbytes + data.draw(st.sampled_from([0, 0, 8]))
        rows.append([pool] + [v for off in offs for v in (off, nbytes)])
    bases = {0: 1 << 40, 1: 2 << 40, 2: 3 << 40}
    stage, stride = 5 << 40, k * nbytes
    runs = pool_runs(rows, names, list(order), nbytes, bases, stage, stride)
    got = {}
    for pool_addr, stage_addr, n in runs:
        for b in range(0, n, nbytes):
            got[stage_addr + b] = pool_addr + b
    want = {}
    for j, row in enumerate(rows):
        for i, name in enumerate(order):
            c = names.index(name)
            want[stage + j * stride + i * nbytes] = bases[row[0]] + row[1 + 2 * c]
    assert got == want
    assert all(n % nbytes == 0 for _, _, n in runs)
    if back_to_back and list(order) == names:
        assert len(runs) <= m  # a block is one run at most


def test_staging_and_host_paths_read_each_others_blocks(client):
    """Blocks saved from a CUDA-shaped (packed NHD) cache load into a CPU-backend cache
    through the host path, and the other way round, bit for bit."""
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 8, 2, 32, 32
    memmove = copier_for("cpu")
    fmt = _fmt(L, H, N, D, torch.float32)
    packed, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "NHD")
    cpu_layout, _ = vllm_like(L, B, H, N, D, torch.float32, "cpu", "HND", seed=2)
    p6 = cuda_cache(packed, "packed")
    host = host_cache(cpu_layout, "cpu")
    save_cuda(client, NS, fmt, p6, _items(HASHES[:3], [1, 2, 3]), copier=memmove)
    assert load_host(client, NS, fmt, host, HASHES[:3], [5, 6, 7]) == 3
    for a, b in zip([1, 2, 3], [5, 6, 7], strict=True):
        for layer in range(L):
            assert torch.equal(_bits(_host_block(cpu_layout[layer], b)), _bits(p6[layer, :, a]))
    other = ["f" * 32, "e" * 32]
    save = HostSave(client, NS, fmt, host, _items(other, [5, 6]))
    save.reserve()
    for layer in range(L):
        save.copy_layer(layer)
    save.seal()
    assert load_cuda(client, NS, fmt, p6, other, [0, 4], copier=memmove) == 2
    assert torch.equal(_bits(p6[:, :, 0]), _bits(p6[:, :, 1]))
    assert torch.equal(_bits(p6[:, :, 4]), _bits(p6[:, :, 2]))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_staging_path_reshards_between_tp_sizes(client, prefill_tp, decode_tp):
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 6, 4, 16, 32
    memmove = copier_for("cpu")
    full, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND")
    f6 = cuda_cache(full, "packed")
    per = H // prefill_tp
    for r in range(prefill_tp):  # each prefill rank holds its heads of the same blocks
        mine, _ = vllm_like(L, B, per, N, D, torch.bfloat16, "cpu", "NHD", seed=9)
        for layer in range(L):
            mine[layer].copy_(full[layer][:, r * per : (r + 1) * per])
        fmt = _fmt(L, per, N, D, torch.bfloat16, r, prefill_tp, total=H)
        save_cuda(
            client,
            NS,
            fmt,
            cuda_cache(mine, "packed"),
            _items(HASHES[:4], [0, 1, 2, 3]),
            copier=memmove,
        )
    per = H // decode_tp
    for r in range(decode_tp):
        out, _ = vllm_like(L, B, per, N, D, torch.bfloat16, "cpu", "NHD", seed=5)
        o6 = cuda_cache(out, "packed")
        fmt = _fmt(L, per, N, D, torch.bfloat16, r, decode_tp, total=H)
        assert (
            load_cuda(
                client,
                NS,
                fmt,
                o6,
                HASHES[:4],
                [5, 4, 3, 2],
                peer_tp_sizes=(prefill_tp,),
                copier=memmove,
            )
            == 4
        )
        for a, b in zip([0, 1, 2, 3], [5, 4, 3, 2], strict=True):
            assert torch.equal(_bits(o6[:, :, b]), _bits(f6[:, :, a, :, r * per : (r + 1) * per]))


# ----------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch sees no CUDA device)")
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cuda_save_and_load_are_bit_exact(client, order):
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda

    L, B, H, N, D = 4, 40, 8, 16, 128
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", order)
    dst, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", order, seed=1)
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6, d6 = cuda_cache(src, "packed"), cuda_cache(dst, "packed")
    hashes = [f"{i:032x}" for i in range(1, 17)]
    src_ids = list(range(20, 36))
    dst_ids = [3 * i % B for i in range(16)]
    with GpuClient(client, own_client=False) as g:
        assert save_cuda(
            g.client,
            NS,
            fmt,
            s6,
            _items(hashes, src_ids),
            stream=g.stream,
            staging_bytes=5 * fmt.block_nbytes,
        ) == (16, 0)
        assert (
            load_cuda(
                g.client,
                NS,
                fmt,
                d6,
                hashes,
                dst_ids,
                stream=g.stream,
                staging_bytes=5 * fmt.block_nbytes,
            )
            == 16
        )
        torch.cuda.synchronize()
    for a, b in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(s6[:, :, a].view(torch.int16), d6[:, :, b].view(torch.int16))
    # sealed with the checksums computed on the GPU, which the CPU's definition confirms
    from kvbroker._client.integrity import verify_objects
    from kvbroker._client.kernels import triton_available

    if triton_available():
        checks = list(verify_objects(client, namespace=NS))
        assert len(checks) == 16 and {c.status for c in checks} == {"ok"}
    # and a host (CPU-backend layout) reader gets the same bytes
    host, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND", seed=3)
    assert load_host(client, NS, fmt, host_cache(host, "cpu"), hashes[:2], [0, 1]) == 2
    for layer in range(L):
        kv = host[layer].view(B, H, 2, N, D)[0].permute(1, 2, 0, 3)
        assert torch.equal(kv.view(torch.int16), s6[layer, :, 20].cpu().view(torch.int16))


@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch sees no CUDA device)")
def test_cuda_save_of_many_one_block_chunks_is_bit_exact(client):
    """One block per chunk: the Python side runs far ahead of the gather stream, so memory a
    chunk's gather still has to read (its block ids) must not be reused by the next chunk
    (a race the 2 GiB benchmark caught)."""
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda

    L, B, H, N, D = 2, 300, 4, 16, 128  # 64 KiB blocks: 160 of them fit the test pool
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda")
    dst, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", seed=1)
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6, d6 = cuda_cache(src, "packed"), cuda_cache(dst, "packed")
    count = 160
    hashes = [f"{i:032x}" for i in range(1, count + 1)]
    src_ids = [(7 * i + 3) % B for i in range(count)]
    dst_ids = [(11 * i + 5) % B for i in range(count)]
    with GpuClient(client, own_client=False) as g:
        assert save_cuda(
            g.client,
            NS,
            fmt,
            s6,
            _items(hashes, src_ids),
            stream=g.stream,
            staging_bytes=2 * fmt.block_nbytes,
        ) == (count, 0)
        assert (
            load_cuda(
                g.client,
                NS,
                fmt,
                d6,
                hashes,
                dst_ids,
                stream=g.stream,
                staging_bytes=2 * fmt.block_nbytes,
            )
            == count
        )
        torch.cuda.synchronize()
    a = torch.tensor(src_ids, device="cuda")
    b = torch.tensor(dst_ids, device="cuda")
    assert torch.equal(s6[:, :, a].view(torch.int16), d6[:, :, b].view(torch.int16))


@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch sees no CUDA device)")
def test_cuda_save_over_blocks_partly_held_gathers_only_the_new_ones(client):
    """A chunk where the node holds some blocks already gathers only the new ones: they land
    whole, the held ones are left as they were."""
    from kvbroker.gpu import GpuClient
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda

    L, B, H, N, D = 2, 40, 4, 16, 128
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda")
    dst, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", seed=1)
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6, d6 = cuda_cache(src, "packed"), cuda_cache(dst, "packed")
    hashes = [f"{i:032x}" for i in range(1, 13)]
    src_ids = [(5 * i + 1) % B for i in range(12)]
    with GpuClient(client, own_client=False) as g:
        first = _items(hashes[:4], src_ids[:4])  # blocks 0-3 held before the second save
        assert save_cuda(g.client, NS, fmt, s6, first, stream=g.stream) == (4, 0)
        # chunks of 1, 1, 3, 3, 2, 1, 1 blocks: the third holds blocks 2 and 3, not 4
        assert save_cuda(
            g.client,
            NS,
            fmt,
            s6,
            _items(hashes, src_ids),
            stream=g.stream,
            staging_bytes=6 * fmt.block_nbytes,
        ) == (8, 4)
        assert load_cuda(g.client, NS, fmt, d6, hashes, list(range(12)), stream=g.stream) == 12
        torch.cuda.synchronize()
    a = torch.tensor(src_ids, device="cuda")
    assert torch.equal(s6[:, :, a].view(torch.int16), d6[:, :, :12].view(torch.int16))


def test_mla_latent_blocks_are_replicated_not_split(client):
    """An MLA cache (one latent row per token, ``[blocks, 1, page, C]`` per layer): each TP
    rank of a prefill engine publishes the same latent under its own shard key, and a decode
    rank of another TP size loads one copy, bit for bit, on the host and the staging path."""
    from kvbroker.integrations.vllm._cuda import load_cuda, save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, N, C = 2, 6, 16, 96
    memmove = copier_for("cpu")
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(L * B * N * C, generator=g).to(torch.bfloat16)
    layers = list(raw.view(L, B, 1, N, C))

    def fmt(rank, size):
        return BlockFormat(
            dtype="bfloat16",
            num_layers=L,
            block_size=N,
            head_dim=C,
            local_heads=1,
            total_kv_heads=None,
            tp_rank=rank,
            tp_size=size,
            heads=(0, 1),
        )

    host = host_cache(layers, "latent")
    for rank in range(2):  # prefill TP 2: both ranks hold (and publish) the whole latent
        save = HostSave(client, NS, fmt(rank, 2), host, _items(HASHES[:3], [0, 1, 2]))
        save.reserve()
        for layer in range(L):
            save.copy_layer(layer)
        save.seal()
    assert len(client.list(namespace=NS)) == 6
    out = list(torch.zeros(L * B * N * C, dtype=torch.bfloat16).view(L, B, 1, N, C))
    o6 = cuda_cache(out, "latent")
    assert (
        load_cuda(
            client, NS, fmt(0, 1), o6, HASHES[:3], [3, 4, 5], peer_tp_sizes=(2,), copier=memmove
        )
        == 3
    )
    for a, b in zip([0, 1, 2], [3, 4, 5], strict=True):
        assert torch.equal(_bits(out[0][b]), _bits(layers[0][a]))
        assert torch.equal(_bits(out[1][b]), _bits(layers[1][a]))
    back = list(torch.zeros(L * B * N * C, dtype=torch.bfloat16).view(L, B, 1, N, C))
    save_cuda(client, NS, fmt(0, 1), o6, _items(["a" * 32], [3]), copier=memmove)
    assert load_host(client, NS, fmt(0, 1), host_cache(back, "latent"), ["a" * 32], [1]) == 1
    assert torch.equal(_bits(back[0][1]), _bits(layers[0][0]))


def test_importing_kvbroker_and_the_connector_package_imports_neither_vllm_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys, kvbroker, kvbroker.integrations.vllm, kvbroker.integrations.vllm._paged, "
        "kvbroker.integrations.vllm._worker, kvbroker.integrations.vllm._scheduler; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_save_refused_for_room_raises_at_once_and_leaves_nothing_leased(make_daemon):
    """A reservation refused (PoolFull) while later chunks' reservations are queued: the save
    raises PoolFull at once (not after the client's timeout, re-reading the reply it had
    already taken) and aborts what the queued reservations got."""
    import time

    from kvbroker.errors import PoolFull
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 8, 1, 16, 32  # 4 KiB blocks: a page each
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    daemon = make_daemon("--pool-size", "12K", "--page-size", "4K")  # three blocks
    with daemon.client(timeout=10) as client:
        started = time.monotonic()
        with pytest.raises(PoolFull):  # one block a chunk: the fourth reservation is refused
            save_cuda(
                client,
                NS,
                fmt,
                cuda_cache(src, "packed"),
                _items(HASHES, range(6)),
                copier=copier_for("cpu"),
                staging_bytes=2 * fmt.block_nbytes,
            )
        assert time.monotonic() - started < 5
        assert [c.write_leases for c in client.stat().clients] == [0]


def test_a_save_when_the_daemon_dies_raises_at_once(make_daemon):
    """The daemon killed mid-save: the save raises BrokerUnavailable at once. Its leases died
    with the connection, so the error path does not reconnect (up to the client's
    ``reconnect`` seconds) just to abort them."""
    import signal
    import time

    from kvbroker.errors import BrokerUnavailable
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 8, 1, 16, 32
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    daemon = make_daemon("--pool-size", "64M", "--page-size", "4K")
    memmove = copier_for("cpu")
    copies = []

    def dying(runs, stream):
        copies.append(runs)
        if len(copies) == 2:
            daemon.stop(signal.SIGKILL)
        return memmove(runs, stream)

    with daemon.client(reconnect=10) as client:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable):
            save_cuda(
                client,
                NS,
                fmt,
                cuda_cache(src, "packed"),
                _items(HASHES, range(6)),
                copier=dying,
                staging_bytes=2 * fmt.block_nbytes,
            )
        assert time.monotonic() - started < 5


def test_a_save_when_the_daemon_stalls_raises_after_one_timeout(make_daemon):
    """The daemon stops answering mid-save (stopped, hung): the save raises Timeout once the
    client's timeout ran out, not after one more timeout per reply its error path would wait
    for (the sealed chunks', the queued reservations')."""
    import signal
    import time

    from kvbroker.errors import Timeout
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 2, 48, 1, 16, 32
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    hashes = [f"{i:032x}" for i in range(1, 41)]
    daemon = make_daemon("--pool-size", "64M", "--page-size", "4K")
    memmove = copier_for("cpu")
    copies = []

    def stalling(runs, stream):
        copies.append(runs)
        if len(copies) == 3:
            daemon.proc.send_signal(signal.SIGSTOP)
        return memmove(runs, stream)

    try:
        with daemon.client(timeout=1, reconnect=0) as client:
            started = time.monotonic()
            with pytest.raises(Timeout):
                save_cuda(
                    client,
                    NS,
                    fmt,
                    cuda_cache(src, "packed"),
                    _items(hashes, range(40)),
                    copier=stalling,
                    staging_bytes=16 * fmt.block_nbytes,
                )
            took = time.monotonic() - started
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert took < 3, f"{took:.1f} s for a 1 s timeout"
    with daemon.client() as other:  # the stalled client's leases ended with its connection
        assert [c.write_leases for c in other.stat().clients] == [0]


def _worker(socket_path, L, H, N, D, caches):
    from kvbroker.integrations._link import BrokerLink, Warnings
    from kvbroker.integrations.vllm._worker import WorkerSide

    w = WorkerSide(
        link=BrokerLink(
            socket_path, name="gpu-test", role="kv_both", map_pools=True, warnings=Warnings()
        ),
        namespace=NS,
        block_size=N,
        total_kv_heads=H,
        latent=False,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
    )
    w.register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)}, "FLASH_ATTN")
    return w


@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch sees no CUDA device)")
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cuda_background_load_lands_after_the_engines_queued_work(daemon, order):
    """load_async on a CUDA cache: start_load returns at once, the copies start only after
    what the engine had queued (here a slow kernel, then a write of the very blocks being
    loaded), and the load is reported once its bytes are in place."""
    import time

    from kvbroker.integrations.vllm._scheduler import LoadSpec, SaveSpec, StepPlan

    L, B, H, N, D = 4, 40, 8, 16, 128
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", order)
    dst, dst_raw = vllm_like(L, B, H, N, D, torch.bfloat16, "cuda", order, seed=1)
    hashes = [f"{i:032x}" for i in range(1, 17)]
    src_ids, dst_ids = list(range(20, 36)), [3 * i % B for i in range(16)]
    producer = _worker(daemon.socket_path, L, H, N, D, src)
    producer.bind(
        StepPlan(
            saves=[
                SaveSpec(
                    "p",
                    [
                        (h, hashes[i - 1] if i else None, b)
                        for i, (h, b) in enumerate(zip(hashes, src_ids, strict=True))
                    ],
                )
            ]
        )
    )
    producer.wait_for_save()
    producer.unbind()
    assert producer.take_stats()["saved_blocks"] == 16
    consumer = _worker(daemon.socket_path, L, H, N, D, dst)
    try:
        engine = torch.cuda.Stream()
        # (its first launch loads the fill kernel, which waits for the GPU: not under the sleep)
        dst_raw.fill_(7)
        torch.cuda.synchronize()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(int(2e9))  # ~1 s of GPU time queued on the engine's stream
            slept = torch.cuda.Event()
            slept.record(engine)
            dst_raw.fill_(7)  # then a write of every block, the ones to load included
            consumer.bind(StepPlan(loads=[LoadSpec("r", hashes, dst_ids, background=True)]))
            started = time.perf_counter()
            consumer.start_load()
            took = time.perf_counter() - started
        assert not slept.query(), f"start_load took {took:.3f} s"  # it did not wait for it
        consumer.unbind()
        # The engine's thread stays free meanwhile (the loader never holds the GIL while it
        # waits for the GPU): the longest pause of this loop is far below the queued work.
        deadline = time.monotonic() + 30
        done, last, longest = None, time.perf_counter(), 0.0
        while done is None and time.monotonic() < deadline:
            done = consumer.finished_loads()
            time.sleep(0.002)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        assert done == {"r"}
        assert slept.query()
        assert longest < 0.2, f"the engine's thread was held up {longest:.3f} s"
        assert time.perf_counter() - started > 0.5  # the load did wait for the engine's work
        assert consumer.load_errors() == set()
        d6, s6 = cuda_cache(dst, "packed"), cuda_cache(src, "packed")
        for a, b in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(s6[:, :, a].view(torch.int16), d6[:, :, b].view(torch.int16))
        assert consumer.finished_loads() is None  # reported once
    finally:
        consumer.close()
        producer.close()


def test_staging_path_reserves_each_requests_blocks_for_its_session(client):
    """Saves of several requests in one step, each naming its own session (or none), go out
    in reservations of one session each: every session retains exactly its request's blocks,
    also where a staging chunk spans two requests."""
    from kvbroker import blocks
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import SaveItem, copier_for

    L, B, H, N, D = 2, 12, 2, 16, 32
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    a, b = [f"a{i:031x}" for i in range(4)], [f"b{i:031x}" for i in range(3)]
    items = [
        SaveItem(h, a[i - 1] if i else None, i, blocks.retention("conv-a")) for i, h in enumerate(a)
    ]
    items += [SaveItem(h, b[i - 1] if i else None, 4 + i) for i, h in enumerate(b)]
    items += [SaveItem(f"c{0:031x}", None, 9, blocks.retention("conv-c", 60, 3))]
    new, _ = save_cuda(
        client,
        NS,
        fmt,
        cuda_cache(src, "packed"),
        items,
        copier=copier_for("cpu"),
        staging_bytes=6 * fmt.block_nbytes,
    )
    assert new == 8
    got = {s["name"]: s for s in client.ops.sessions()["sessions"]}
    assert {n: s["blocks"] for n, s in got.items()} == {"conv-a": 4, "conv-c": 1}
    assert got["conv-c"]["priority"] == 3
