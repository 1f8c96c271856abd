"""Heterogeneous tensor parallelism: P prefill shards -> D decode ranks, through a real daemon.

The reference is the full cache of all H heads; every decode rank's assembled KV must equal
the slice of it that shard_D(d) names, bit for bit, at the decode rank's own block ids.
"""

from __future__ import annotations

import itertools
import multiprocessing
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DaemonProcess
from kvbroker import Client, Incomplete, LayoutMismatch, NotFound
from kvbroker._client.tp import claim_plan, readers_of, shard_heads
from kvbroker.kv import UNKNOWN_CONSUMERS, PagedKV, claim_shards, publish_shard, shard_key

HEADS = [1, 2, 4, 8, 32, 40, 64]
TPS = [1, 2, 4, 8]
LAYOUTS = {
    "blocks-first NHD": ("block", "kv", "token", "head", "head_dim"),
    "kv-first HND": ("kv", "block", "head", "token", "head_dim"),
}
CANONICAL = ("kv", "block", "token", "head", "head_dim")
DTYPES = [("numpy", "float16"), ("numpy", "float32"), ("torch", "bfloat16"), ("torch", "float16")]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(("torch", "float8_e4m3fn"))
_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
_requests = itertools.count()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    d = DaemonProcess(
        str(tmp_path_factory.mktemp("kvtp") / "kvb.sock"), "--pool-size", "64M", "--page-size", "4K"
    )
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def tp_client(shared_daemon):
    with shared_daemon.client() as c:
        yield c


# -- reference construction ---------------------------------------------------------------------
def random_bits(rng, shape, itemsize):
    """Random bit patterns (NaNs and all): the copies must not care what the bits mean."""
    return rng.integers(0, 256, size=(*shape, itemsize), dtype=np.uint8).view(f"u{itemsize}")[
        ..., 0
    ]


def engine_cache(full, heads: range, axes, block_size, num_blocks, ids, rng, kind, dtype):
    """A rank's cache in ``axes`` order holding ``full[:, :, t, heads]`` at block ids[t // bs].

    ``full`` is unsigned-int bits [layer, kv, token, head, dim]; other slots get garbage.
    Returns (the engine's per-layer tensors, canonical int views for checking).
    """
    layers, comps, tokens, _, dim = full.shape
    itemsize = full.dtype.itemsize
    canon = random_bits(rng, (layers, comps, num_blocks, block_size, len(heads), dim), itemsize)
    for t in range(tokens):
        canon[:, :, ids[t // block_size], t % block_size] = full[:, :, t, heads.start : heads.stop]
    order = [1 + CANONICAL.index(a) for a in axes]
    per_layer = [
        np.ascontiguousarray(canon[i].transpose([o - 1 for o in order])) for i in range(layers)
    ]
    if kind == "torch":
        tensors = [torch.from_numpy(a).view(getattr(torch, dtype)) for a in per_layer]
    else:
        tensors = [a.view(dtype) for a in per_layer]
    return tensors, per_layer


def latent_cache(full, block_size, num_blocks, ids, rng):
    layers, _, tokens, _, dim = full.shape
    canon = random_bits(rng, (layers, num_blocks, block_size, dim), full.dtype.itemsize)
    for t in range(tokens):
        canon[:, ids[t // block_size], t % block_size] = full[:, 0, t, 0]
    return [canon[i] for i in range(layers)]


def assert_decode_rank_exact(full, heads: range, axes, per_layer_bits, block_size, ids):
    for layer, bits in enumerate(per_layer_bits):
        canon = bits.transpose([axes.index(a) for a in CANONICAL])
        for t in range(full.shape[2]):
            got = canon[:, ids[t // block_size], t % block_size]
            want = full[layer, :, t, heads.start : heads.stop]
            assert np.array_equal(got, want), f"layer {layer} token {t} differs"


def block_ids(rng, tokens, block_size, spare=2):
    needed = -(-tokens // block_size)
    num_blocks = needed + spare
    return rng.permutation(num_blocks)[:needed].tolist(), num_blocks


def rank_cache(full, heads: range, axes, block_size, rng, kind="numpy", dtype="float16"):
    """One rank's fresh cache holding ``full``'s ``heads`` at new random block ids (see
    :func:`engine_cache`): (the engine's per-layer tensors, their bit views, the block ids)."""
    ids, num_blocks = block_ids(rng, full.shape[2], block_size)
    tensors, bits = engine_cache(full, heads, axes, block_size, num_blocks, ids, rng, kind, dtype)
    return tensors, bits, ids


def publish_prefill_ranks(
    client, request, full, P, axes, block_size, rng, kind="numpy", dtype="float16", decode_tp_size=1
):
    """Each of ``P`` prefill ranks publishes its shard of ``full``'s heads from a fresh cache in
    ``axes`` order; their results, rank by rank."""
    tokens, H = full.shape[2], full.shape[3]
    results = []
    for p in range(P):
        tensors, _, ids = rank_cache(full, shard_heads(p, P, H), axes, block_size, rng, kind, dtype)
        results.append(
            publish_shard(
                client,
                request,
                PagedKV(tensors, axes),
                ids,
                tokens,
                tp_rank=p,
                tp_size=P,
                total_kv_heads=H,
                decode_tp_size=decode_tp_size,
            )
        )
    return results


def run_handoff(
    client, H, P, D, kind, dtype, axes_p, axes_d, bs_p, bs_d, layers, tokens, dim, seed
):
    """Publish from P ranks, claim into D ranks; check exactness, copy bound and freeing."""
    rng = np.random.default_rng(seed)
    request = f"req{next(_requests)}"
    itemsize = _ITEMSIZE[dtype]
    full = random_bits(rng, (layers, 2, tokens, H, dim), itemsize)
    published = publish_prefill_ranks(client, request, full, P, axes_p, bs_p, rng, kind, dtype, D)
    for p, res in enumerate(published):
        assert res.published == (readers_of(p, H, P, D) > 0)
        assert res.copy_ops <= 2 * layers * 2
    for d in range(D):
        mine = shard_heads(d, D, H)
        tensors, bits, ids = rank_cache(np.zeros_like(full), mine, axes_d, bs_d, rng, kind, dtype)
        res = claim_shards(
            client,
            request,
            PagedKV(tensors, axes_d),
            ids,
            tp_rank=d,
            tp_size=D,
            prefill_tp_size=P,
            total_kv_heads=H,
            wait=5,
        )
        shards = len(res.keys)
        assert shards == len({p.prefill_rank for p in claim_plan(H, P, D, d)})
        assert shards == (max(1, P * len(mine) // H) if P <= H else len(mine))  # one copy per head
        assert res.source_runs == layers * 2 * shards
        per_shard = int(tokens >= bs_d) + int(tokens % bs_d != 0)
        assert res.copy_ops == layers * 2 * shards * per_shard <= 2 * layers * 2 * shards
        assert res.nbytes == layers * 2 * tokens * len(mine) * dim * itemsize
        assert_decode_rank_exact(full, mine, axes_d, bits, bs_d, ids)
    leftover = [o.key for o in client.list(match=f"{request}/.*")]
    assert leftover == [], f"not freed after every decode rank claimed: {leftover}"


# -- the sharding arithmetic --------------------------------------------------------------------
def test_replicated_heads_use_div_not_mod():
    assert [shard_heads(r, 8, 2) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert shard_heads(3, 4, 8) == range(6, 8)
    assert shard_heads(0, 1, 40) == range(0, 40)


@settings(max_examples=200, deadline=None)
@given(H=st.sampled_from(HEADS), P=st.sampled_from(TPS), D=st.sampled_from(TPS))
def test_plan_covers_each_needed_head_once_from_a_holder(H, P, D):
    for d in range(D):
        need = shard_heads(d, D, H)
        got = []
        for piece in claim_plan(H, P, D, d):
            src = shard_heads(piece.prefill_rank, P, H)
            heads = range(src.start + piece.src_head, src.start + piece.src_head + piece.count)
            assert heads.stop <= src.stop
            assert piece.dst_head == heads.start - need.start
            got.extend(heads)
        assert got == list(need)
    assert sum(readers_of(p, H, P, D) for p in range(P)) == sum(
        len({pc.prefill_rank for pc in claim_plan(H, P, D, d)}) for d in range(D)
    )


# -- end to end ---------------------------------------------------------------------------------
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    H=st.sampled_from(HEADS),
    P=st.sampled_from(TPS),
    D=st.sampled_from(TPS),
    dtype=st.sampled_from(DTYPES),
    axes_p=st.sampled_from(sorted(LAYOUTS)),
    axes_d=st.sampled_from(sorted(LAYOUTS)),
    bs_p=st.sampled_from([1, 4, 16]),
    bs_d=st.sampled_from([1, 4, 16]),
    layers=st.integers(1, 3),
    tokens=st.integers(1, 40),
    dim=st.sampled_from([1, 4, 8, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_decode_rank_gets_exactly_its_heads(
    tp_client, H, P, D, dtype, axes_p, axes_d, bs_p, bs_d, layers, tokens, dim, seed
):
    assume(H * tokens * dim * layers <= 64 * 40 * 4)  # keep each example small
    kind, name = dtype
    run_handoff(
        tp_client,
        H,
        P,
        D,
        kind,
        name,
        LAYOUTS[axes_p],
        LAYOUTS[axes_d],
        bs_p,
        bs_d,
        layers,
        tokens,
        dim,
        seed,
    )


@pytest.mark.parametrize(
    "H,P,D", [(8, 4, 1), (8, 1, 4), (8, 2, 2), (2, 8, 8), (2, 8, 2), (40, 8, 2), (1, 4, 2)]
)
def test_named_configurations(tp_client, H, P, D):
    run_handoff(
        tp_client,
        H,
        P,
        D,
        "torch",
        "bfloat16",
        LAYOUTS["blocks-first NHD"],
        LAYOUTS["kv-first HND"],
        4,
        16,
        2,
        37,
        8,
        seed=H * 100 + P * 10 + D,
    )


@pytest.mark.parametrize(
    "P,D,axes",
    [
        (1, 1, "blocks-first NHD"),
        (2, 1, "blocks-first NHD"),
        (1, 2, "blocks-first NHD"),
        (1, 1, "kv-first HND"),
    ],
)
def test_whole_row_and_head_major_scatters(tp_client, P, D, axes):
    # head_dim 128 x 8 heads x 2 bytes = 2 KiB rows: a full-row NHD claim copies in row order,
    # a partial one (or HND) head by head. Both must be bit-exact.
    run_handoff(
        tp_client,
        8,
        P,
        D,
        "torch",
        "bfloat16",
        LAYOUTS["blocks-first NHD"],
        LAYOUTS[axes],
        4,
        16,
        2,
        37,
        128,
        seed=P * 10 + D,
    )


def test_copy_ops_do_not_grow_with_tokens(tp_client):
    ops = set()
    for tokens in (16, 160, 1600):
        rng = np.random.default_rng(tokens)
        full = random_bits(rng, (2, 2, tokens, 4, 8), 2)
        publish_prefill_ranks(tp_client, f"grow{tokens}", full, 2, LAYOUTS["kv-first HND"], 16, rng)
        t, _, ids = rank_cache(full, range(4), LAYOUTS["kv-first HND"], 16, rng)
        res = claim_shards(
            tp_client,
            f"grow{tokens}",
            PagedKV(t, LAYOUTS["kv-first HND"]),
            ids,
            tp_rank=0,
            tp_size=1,
            prefill_tp_size=2,
            total_kv_heads=4,
        )
        ops.add(res.copy_ops)
    assert ops == {2 * 2 * 2}


def test_mla_latent_any_one_copy_serves_every_rank(tp_client):
    rng = np.random.default_rng(7)
    layers, tokens, dim, P, D = 3, 21, 12, 4, 2
    full = random_bits(rng, (layers, 1, tokens, 1, dim), 2)
    axes = ("block", "token", "head_dim")
    for p in range(P):
        ids, nb = block_ids(rng, tokens, 4)
        arrays = [a.view(np.float16) for a in latent_cache(full, 4, nb, ids, rng)]
        res = publish_shard(
            tp_client,
            "mla",
            PagedKV(arrays, axes),
            ids,
            tokens,
            tp_rank=p,
            tp_size=P,
            total_kv_heads=None,
            decode_tp_size=D,
        )
        assert res.published == (p < D)  # decode rank d reads copy d mod P; others are unused
    for d in range(D):
        ids, nb = block_ids(rng, tokens, 8)
        arrays = [np.zeros((nb, 8, dim), np.float16) for _ in range(layers)]
        res = claim_shards(
            tp_client,
            "mla",
            PagedKV(arrays, axes),
            ids,
            tp_rank=d,
            tp_size=D,
            prefill_tp_size=P,
            total_kv_heads=None,
        )
        assert res.keys == [shard_key("mla", d % P, P)] and res.copy_ops == layers * 2
        for t in range(tokens):
            got = np.stack([a[ids[t // 8], t % 8].view(np.uint16) for a in arrays])
            assert np.array_equal(got, full[:, 0, t, 0])
    assert tp_client.list(match="mla/.*") == []


# -- errors and lifetimes -----------------------------------------------------------------------
def _publish_simple(
    client,
    request,
    P=2,
    H=4,
    dim=8,
    layers=2,
    tokens=10,
    dtype=np.float16,
    ranks=None,
    decode_tp_size=1,
):
    axes = LAYOUTS["blocks-first NHD"]
    for p in range(P) if ranks is None else ranks:
        cache = [np.ones((3, 2, 4, H // P, dim), dtype) for _ in range(layers)]
        publish_shard(
            client,
            request,
            PagedKV(cache, axes),
            [0, 1, 2],
            tokens,
            tp_rank=p,
            tp_size=P,
            total_kv_heads=H,
            decode_tp_size=decode_tp_size,
        )


def _decode_cache(H=4, dim=8, layers=2, dtype=np.float16):
    return PagedKV(
        [np.zeros((3, 2, 4, H, dim), dtype) for _ in range(layers)], LAYOUTS["blocks-first NHD"]
    )


def test_unknown_request_is_not_found(tp_client):
    with pytest.raises(NotFound, match="unknown"):
        claim_shards(
            tp_client,
            "nobody",
            _decode_cache(),
            [0, 1, 2],
            tp_rank=0,
            tp_size=1,
            prefill_tp_size=2,
            total_kv_heads=4,
            wait=0.2,
        )


def test_incomplete_request_waits_then_fails_and_consumes_nothing(tp_client):
    _publish_simple(tp_client, "half", ranks=[0])
    with pytest.raises(Incomplete, match=r"half/tp1of2"):
        claim_shards(
            tp_client,
            "half",
            _decode_cache(),
            [0, 1, 2],
            tp_rank=0,
            tp_size=1,
            prefill_tp_size=2,
            total_kv_heads=4,
            wait=0.3,
        )
    _publish_simple(tp_client, "half", ranks=[1])  # the late shard arrives; a retry succeeds
    res = claim_shards(
        tp_client,
        "half",
        _decode_cache(),
        [0, 1, 2],
        tp_rank=0,
        tp_size=1,
        prefill_tp_size=2,
        total_kv_heads=4,
    )
    assert res.num_tokens == 10 and tp_client.list(match="half/.*") == []


@pytest.mark.parametrize(
    "cache,kwargs,field",
    [
        (lambda: _decode_cache(dtype=np.float32), {}, "dtype"),
        (lambda: _decode_cache(dim=4), {}, "head_dim"),
        (lambda: _decode_cache(layers=3), {}, "layers"),
        (lambda: _decode_cache(H=8), {"total_kv_heads": 8}, "total KV heads"),
        (lambda: _decode_cache(H=2), {}, "KV heads"),
        (lambda: _decode_cache(), {"num_tokens": 12}, "num_tokens"),
        (lambda: _decode_cache(), {"block_ids": [0, 1]}, "block size"),
        (lambda: _decode_cache(), {"infix": "P0"}, "infix"),
    ],
)
def test_mismatched_layouts_fail_clearly_and_leave_the_request(tp_client, cache, kwargs, field):
    request = f"mm{next(_requests)}"
    _publish_simple(tp_client, request)
    args = {"tp_rank": 0, "tp_size": 1, "prefill_tp_size": 2, "total_kv_heads": 4, **kwargs}
    ids = args.pop("block_ids", [0, 1, 2])
    with pytest.raises((LayoutMismatch, NotFound), match=field):
        claim_shards(tp_client, request, cache(), ids, **args)
    assert len(tp_client.list(match=f"{request}/.*")) == 2  # nothing consumed


def test_freed_only_after_every_decode_rank_claimed(tp_client):
    H, P, D = 4, 1, 4  # one shard read by four decode ranks
    _publish_simple(tp_client, "fan", P=P, H=H, decode_tp_size=D)
    for d in range(D):
        assert tp_client.exists(shard_key("fan", 0, P))
        cache = PagedKV(
            [np.zeros((3, 2, 4, 1, 8), np.float16) for _ in range(2)], LAYOUTS["blocks-first NHD"]
        )
        claim_shards(
            tp_client,
            "fan",
            cache,
            [0, 1, 2],
            tp_rank=d,
            tp_size=D,
            prefill_tp_size=P,
            total_kv_heads=H,
        )
    assert not tp_client.exists(shard_key("fan", 0, P))


def test_unknown_decode_tp_leaves_freeing_to_eviction(tp_client):
    _publish_simple(tp_client, "ttl", decode_tp_size=None)
    info = tp_client.lookup(shard_key("ttl", 0, 2))
    assert info.meta["decode_tp_size"] is None
    claim_shards(
        tp_client,
        "ttl",
        _decode_cache(),
        [0, 1, 2],
        tp_rank=0,
        tp_size=1,
        prefill_tp_size=2,
        total_kv_heads=4,
    )
    assert len(tp_client.list(match="ttl/.*")) == 2  # still there for other readers
    assert tp_client.evict(match="ttl/.*").count == 2
    assert UNKNOWN_CONSUMERS == 1 << 16


def test_importing_kvbroker_does_not_import_torch():
    code = (
        "import sys, kvbroker, kvbroker.kv, kvbroker.layout, kvbroker.cli; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- separate processes -------------------------------------------------------------------------
def _prefill_process(socket_path, request, p, P, D, H, seed):
    rng = np.random.default_rng(seed)
    full = random_bits(rng, (2, 2, 33, H, 8), 2)
    rng = np.random.default_rng(seed + 1 + p)
    tensors, _, ids = rank_cache(
        full, shard_heads(p, P, H), LAYOUTS["blocks-first NHD"], 4, rng, "torch", "bfloat16"
    )
    with Client(socket_path) as c:
        publish_shard(
            c,
            request,
            PagedKV(tensors, LAYOUTS["blocks-first NHD"]),
            ids,
            33,
            tp_rank=p,
            tp_size=P,
            total_kv_heads=H,
            decode_tp_size=D,
        )


def _decode_process(socket_path, request, d, P, D, H, seed, queue):
    full = random_bits(np.random.default_rng(seed), (2, 2, 33, H, 8), 2)
    rng = np.random.default_rng(seed + 100 + d)
    mine = shard_heads(d, D, H)
    tensors, bits, ids = rank_cache(
        np.zeros_like(full), mine, LAYOUTS["kv-first HND"], 16, rng, "torch", "bfloat16"
    )
    with Client(socket_path) as c:
        res = claim_shards(
            c,
            request,
            PagedKV(tensors, LAYOUTS["kv-first HND"]),
            ids,
            tp_rank=d,
            tp_size=D,
            prefill_tp_size=P,
            total_kv_heads=H,
            wait=240,
        )
    assert_decode_rank_exact(full, mine, LAYOUTS["kv-first HND"], bits, 16, ids)
    queue.put((d, res.copy_ops, len(res.keys)))


@pytest.mark.parametrize("P,D", [(4, 2), (2, 4)])
def test_prefill_and_decode_in_separate_processes(shared_daemon, tp_client, P, D):
    H, seed, request = 8, 1234 + P, f"mp{P}{D}"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    # Decode ranks start first and wait for the shards: the claim's bounded wait in action.
    decoders = [
        ctx.Process(
            target=_decode_process,
            args=(shared_daemon.socket_path, request, d, P, D, H, seed, queue),
        )
        for d in range(D)
    ]
    prefills = [
        ctx.Process(
            target=_prefill_process, args=(shared_daemon.socket_path, request, p, P, D, H, seed)
        )
        for p in range(P)
    ]
    for proc in decoders + prefills:
        proc.start()
    # Bounds against a hang only: six spawned processes importing torch on a loaded 2-core
    # machine took more than the 30 s the decoders once waited (a failure with no defect).
    deadline = time.monotonic() + 240
    for proc in decoders + prefills:
        proc.join(max(1.0, deadline - time.monotonic()))
        assert proc.exitcode == 0
    results = sorted(queue.get(timeout=5) for _ in range(D))
    shards = max(1, P // D)
    assert [r[2] for r in results] == [shards] * D
    assert all(ops <= 2 * 2 * 2 * shards for _, ops, _ in results)
    assert tp_client.list(match=f"{request}/.*") == []


def test_a_consume_claim_released_uncounted_consumes_nothing(tp_client):
    tp_client.put("uncounted", {"x": b"abc"}, consumers=1)
    lease = tp_client.claim("uncounted", consume=True)
    tp_client._call("release", lease=lease.id, consume=False)  # the reader gave up, unused
    assert tp_client.exists("uncounted")
    tp_client.claim("uncounted", consume=True).release()
    tp_client.stat()  # the pipelined release is answered before this, in order
    assert not tp_client.exists("uncounted")


class _CountingArray(np.ndarray):
    """An engine cache that counts the writes into it, through any view of it: the claim's
    copy operations counted from the outside, not by what the claim reports of itself."""

    writes = 0

    def __setitem__(self, index, value):
        _CountingArray.writes += 1
        super().__setitem__(index, value)


@pytest.mark.parametrize("axes", ["kv-first HND", "blocks-first NHD"])
def test_claim_writes_do_not_grow_with_tokens_counted_independently(tp_client, axes):
    """Token counts with a 15-token tail block: a scatter that wrote the tail (or any part)
    token by token would write 15x more often at every size."""
    layers, comps, shards, kv_heads = 2, 2, 2, 4
    seen = {}
    for tokens in (31, 175, 1711):
        rng = np.random.default_rng(tokens)
        full = random_bits(rng, (layers, comps, tokens, kv_heads, 8), 2)
        publish_prefill_ranks(
            tp_client, f"count{axes}{tokens}", full, shards, LAYOUTS["kv-first HND"], 16, rng
        )
        t, bits, ids = rank_cache(full, range(kv_heads), LAYOUTS[axes], 16, rng)
        counted = [a.view(_CountingArray) for a in t]
        _CountingArray.writes = 0
        claim_shards(
            tp_client,
            f"count{axes}{tokens}",
            PagedKV(counted, LAYOUTS[axes]),
            ids,
            tp_rank=0,
            tp_size=1,
            prefill_tp_size=shards,
            total_kv_heads=kv_heads,
        )
        seen[tokens] = _CountingArray.writes
        assert_decode_rank_exact(full, range(kv_heads), LAYOUTS[axes], bits, 16, ids)
    # one write for the full blocks and one for the tail, per layer, component and shard
    assert seen == {n: layers * comps * shards * 2 for n in seen}, seen


def test_a_big_handoff_copies_on_the_engines_threads_and_seals_their_hashes(tp_client, monkeypatch):
    """publish_shard gathers and hashes each (layer, K/V) buffer on the copy engine's threads
    (the seal hashes nothing again) and claim_shards scatters on them: the recorded checksums
    are the buffers' own, and the decode rank's cache is bit-exact."""
    import threading

    import kvbroker.kv as kv
    from kvbroker._client import engine as _engine
    from kvbroker._client import integrity as _integrity

    eng = _engine.CopyEngine(threads=4)
    monkeypatch.setattr(_engine, "_default", eng)
    # Which share of the engine's work each gather and scatter ran in: the engine hands
    # shares to its workers, but a thread that finds one not started yet runs it itself (a
    # loaded machine's workers may start none), so the threads that ran them prove nothing.
    share = threading.local()
    shares = {"_gather": set(), "_scatter": set()}
    real_spread = eng._spread

    def spread(calls):
        def in_share(i, fn, *args):
            share.at = (id(calls), i)
            try:
                return fn(*args)
            finally:
                share.at = None

        return real_spread([(in_share, i, *call) for i, call in enumerate(calls)])

    monkeypatch.setattr(eng, "_spread", spread)
    for name in shares:
        real = getattr(kv, name)

        def spy(*args, _real=real, _name=name):
            shares[_name].add(getattr(share, "at", None))
            return _real(*args)

        monkeypatch.setattr(kv, name, spy)
    reference = _integrity.digest
    hashed_again = []

    def counted(view, kind=1):
        hashed_again.append(1)
        return reference(view, kind)

    monkeypatch.setattr(_integrity, "digest", counted)

    H, P, layers, tokens, dim, bs = 8, 2, 8, 512, 128, 16  # 512 KiB per buffer, 8 MiB a shard
    rng = np.random.default_rng(7)
    request = f"req{next(_requests)}"
    full = random_bits(rng, (layers, 2, tokens, H, dim), 2)
    axes = LAYOUTS["blocks-first NHD"]
    publish_prefill_ranks(tp_client, request, full, P, axes, bs, rng, "torch", "bfloat16")
    assert hashed_again == []
    for p in range(P):
        with tp_client.claim(shard_key(request, p, P)) as lease:
            names = sorted(lease.checksums)
            assert len(names) == layers * 2
            assert all(lease.checksums[n] == reference(lease[n]) for n in names)
            lease.release(consume=False)
    tensors, bits, ids = rank_cache(
        np.zeros_like(full), range(H), axes, bs, rng, "torch", "bfloat16"
    )
    claim_shards(
        tp_client,
        request,
        PagedKV(tensors, axes),
        ids,
        tp_rank=0,
        tp_size=1,
        prefill_tp_size=P,
        total_kv_heads=H,
    )
    assert_decode_rank_exact(full, range(H), axes, bits, bs, ids)
    for name, where in shares.items():  # split into shares of the engine, never outside
        assert None not in where and len(where) > 1, (name, where)
