"""Prefix reuse across DP ranks: chained hashes, longest-prefix match, isolation, eviction."""

import itertools
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import DaemonProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker import BadRequest, BrokerUnavailable, Client, KVBrokerError, LayoutMismatch
from kvbroker._client.tp import shard_heads
from kvbroker.kv import PagedKV
from kvbroker.prefix import PrefixCache, block_hashes, shard_block_key

BLOCK = 16
LAYERS = 2
BLOCK_BYTES = BLOCK * 2 * 8 * 4  # tokens x (k,v) x heads x head_dim... of uint8


def kv_block(tokens, layer):
    """Deterministic per-block KV that depends on the whole prefix, like real attention KV."""
    seed = int(np.sum(np.asarray(tokens, dtype=np.int64) * np.arange(1, len(tokens) + 1)) % 2**32)
    return np.random.default_rng([seed, layer]).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def blocks_for(tokens):
    return [
        {f"past_key.{layer}": kv_block(tokens[: (b + 1) * BLOCK], layer) for layer in range(LAYERS)}
        for b in range(len(tokens) // BLOCK)
    ]


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def test_hashes_chain_and_are_stable_across_processes():
    toks = prompt(100, 1)
    h = block_hashes(toks, BLOCK, namespace="ns", cache_salt="s")
    assert len(h) == 100 // BLOCK and len(set(h)) == len(h)
    # a block's hash depends on everything before it
    changed = list(toks)
    changed[0] += 1
    h2 = block_hashes(changed, BLOCK, namespace="ns", cache_salt="s")
    assert all(a != b for a, b in zip(h, h2, strict=True))
    assert block_hashes(toks[:50], BLOCK, namespace="ns", cache_salt="s") == h[:3]
    assert block_hashes(toks, BLOCK, namespace="ns", cache_salt="t") != h
    assert block_hashes(toks, BLOCK, namespace="other", cache_salt="s") != h
    code = (
        "from kvbroker.prefix import block_hashes; import sys;"
        f"print(','.join(block_hashes({toks!r}, {BLOCK}, namespace='ns', cache_salt='s')))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        assert out.stdout.strip().split(",") == h


def _rank0_prefill(sock, tokens, done):
    with Client(sock, name="dp0") as c:
        pc = PrefixCache(c, block_size=BLOCK)
        assert pc.publish(tokens, blocks_for(tokens)) == len(tokens) // BLOCK
        assert pc.publish(tokens, blocks_for(tokens)) == 0  # already there: no copy
    done.set()


def test_dp_rank_reuses_3k_of_4k_prefix(make_daemon):
    d = make_daemon("--pool-size", "64M")
    p0 = prompt(4096, 7)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_rank0_prefill, args=(d.socket_path, p0, done))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and done.is_set()
    p1 = p0[:3072] + prompt(1000, 8)
    with d.client(name="dp1") as c:
        pc = PrefixCache(c, block_size=BLOCK)
        with pc.match(p1) as m:
            assert m.num_tokens == 3072 and m.num_blocks == 3072 // BLOCK
            want = blocks_for(p1[:3072])
            for b, blk in enumerate(m.blocks):
                for layer in range(LAYERS):
                    name = f"past_key.{layer}"
                    assert np.array_equal(blk[name], want[b][name])
            s = c.stat()  # one lease pins every matched block
            assert s.read_leases == 1 and s.pools[0].leased_read >= m.num_blocks * 2048
        s = c.stat()  # the pipelined release is answered before this, in order
        assert s.read_leases == 0
        assert s.counters.prefix_hit_tokens == 3072 and s.counters.prefix_hit_blocks == 192


def test_match_never_returns_the_whole_prompt(client):
    pc = PrefixCache(client, block_size=BLOCK)
    toks = prompt(64, 3)
    pc.publish(toks, blocks_for(toks))
    with pc.match(toks) as m:  # 64 tokens, 4 blocks published: at most 63 usable -> 3 blocks
        assert m.num_tokens == 48
    with pc.match(toks + [1]) as m:
        assert m.num_tokens == 64
    with pc.match(toks[:1]) as m:
        assert m.num_tokens == 0


def test_salts_and_namespaces_isolate(client):
    toks = prompt(128, 4)
    PrefixCache(client, block_size=BLOCK, cache_salt="tenant-a").publish(toks, blocks_for(toks))
    for pc in (
        PrefixCache(client, block_size=BLOCK, cache_salt="tenant-b"),
        PrefixCache(client, block_size=BLOCK, cache_salt=""),
        PrefixCache(client, block_size=BLOCK, cache_salt="tenant-a", namespace="x"),
    ):
        with pc.match(toks + [0]) as m:
            assert m.num_tokens == 0
    with PrefixCache(client, block_size=BLOCK, cache_salt="tenant-a").match(toks + [0]) as m:
        assert m.num_tokens == 128


def test_publish_by_function_gathers_only_missing_blocks(client):
    toks = prompt(96, 5)
    pc = PrefixCache(client, block_size=BLOCK)
    pc.publish(toks[:48], blocks_for(toks[:48]))
    asked = []

    def block(i):
        asked.append(i)
        return blocks_for(toks)[i]

    sizes = {f"past_key.{layer}": BLOCK_BYTES for layer in range(LAYERS)}
    assert pc.publish(toks, block, block_sizes=sizes) == 3
    assert asked == [3, 4, 5]


def test_eviction_is_leaf_first_and_never_under_a_reader(make_daemon):
    # 12 pages of 4 KiB; every block object takes one page
    d = make_daemon(
        "--pool-size",
        "48K",
        "--page-size",
        "4K",
        "--high-watermark",
        "1.0",
        "--low-watermark",
        "1.0",
    )
    with d.client() as c:
        pc = PrefixCache(c, block_size=BLOCK)
        chain = prompt(8 * BLOCK, 11)
        pc.publish(chain, blocks_for(chain))
        hashes = pc.hashes(chain)
        # a reader pins the first 3 blocks
        held = pc.match(chain[: 3 * BLOCK + 1])
        assert held.num_blocks == 3
        # pressure: a new 6-block chain must evict 2 blocks (12 pages, 8 used)
        other = prompt(6 * BLOCK, 12)
        pc.publish(other, blocks_for(other))
        present = [c.exists(h, namespace="prefix") for h in hashes]
        # the chain lost its last blocks, never a middle one
        assert present == [True] * 6 + [False] * 2
        # more pressure: leaves go first, the held prefix stays intact
        more = prompt(4 * BLOCK, 13)
        pc.publish(more, blocks_for(more))
        present = [c.exists(h, namespace="prefix") for h in hashes]
        k = present.index(False) if False in present else len(present)
        assert all(present[:k]) and not any(present[k:]) and k >= 3
        want = blocks_for(chain[: 3 * BLOCK])
        for b in range(3):
            assert np.array_equal(held.blocks[b]["past_key.0"], want[b]["past_key.0"])
        held.release()


def _matcher(sock, tokens, rounds, errors):
    try:
        with Client(sock) as c:
            pc = PrefixCache(c, block_size=BLOCK)
            want = blocks_for(tokens)
            for _ in range(rounds):
                with pc.match(tokens + [0]) as m:
                    for b, blk in enumerate(m.blocks):
                        if not np.array_equal(blk["past_key.1"], want[b]["past_key.1"]):
                            errors.put(f"block {b} changed under its reader")
                            return
    except Exception as exc:
        errors.put(repr(exc))


def _churner(sock, rounds, errors):
    try:
        with Client(sock) as c:
            pc = PrefixCache(c, block_size=BLOCK)
            for r in range(rounds):
                toks = prompt(4 * BLOCK, 1000 + r)
                pc.publish(toks, blocks_for(toks))
    except Exception as exc:
        errors.put(repr(exc))


def test_concurrent_matches_under_eviction_pressure(make_daemon):
    d = make_daemon("--pool-size", "96K", "--page-size", "4K")
    shared = prompt(6 * BLOCK, 99)
    with d.client() as c:
        PrefixCache(c, block_size=BLOCK).publish(shared, blocks_for(shared))
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_matcher, args=(d.socket_path, shared, 200, errors)) for _ in range(2)
    ]
    procs.append(ctx.Process(target=_churner, args=(d.socket_path, 150, errors)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs)
    with d.client() as c:
        s = c.stat()
        assert s.read_leases == 0 and s.counters.evictions > 0


# -- tensor parallelism: shard-wise reuse and resharding across TP layouts ----------------------
KV_LAYOUTS = {
    "NHD": ("block", "kv", "token", "head", "head_dim"),
    "HND": ("kv", "block", "head", "token", "head_dim"),
}
_CANON = ("kv", "block", "token", "head", "head_dim")
_namespaces = itertools.count()


@pytest.fixture(scope="module")
def tp_daemon(tmp_path_factory):
    d = DaemonProcess(
        str(tmp_path_factory.mktemp("pfxtp") / "kvb.sock"),
        "--pool-size",
        "64M",
        "--page-size",
        "4K",
    )
    yield d
    assert d.stop() == 0, d.log()


def full_kv(seed, layers, tokens, heads, dim):
    """Reference KV bits [layer, kv, token, head, dim]: random patterns, NaNs and all."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**16, (layers, 2, tokens, heads, dim), dtype=np.uint16)


def rank_cache(full, heads: range, axes, block, rng, fill=True):
    """An engine cache in ``axes`` holding ``full[..., heads, :]`` (or garbage) at scattered
    block ids; returns (PagedKV over float16 views, block ids, per-layer uint16 arrays)."""
    layers, _, tokens, _, dim = full.shape
    needed = -(-tokens // block)
    num_blocks = needed + 3
    ids = rng.permutation(num_blocks)[:needed]
    canon = rng.integers(0, 2**16, (layers, 2, num_blocks, block, len(heads), dim), dtype=np.uint16)
    if fill:
        for t in range(tokens):
            canon[:, :, ids[t // block], t % block] = full[:, :, t, heads.start : heads.stop]
    order = [_CANON.index(a) for a in axes]
    bits = [np.ascontiguousarray(canon[i].transpose(order)) for i in range(layers)]
    return PagedKV([b.view(np.float16) for b in bits], axes), ids, bits


def assert_loaded(full, heads: range, axes, bits, ids, block, tokens):
    for layer, b in enumerate(bits):
        canon = b.transpose([axes.index(a) for a in _CANON])  # [kv, block, token, head, dim]
        got = canon[:, ids[: tokens // block]].reshape(2, tokens, len(heads), full.shape[-1])
        want = full[layer, :, :tokens, heads.start : heads.stop]
        assert np.array_equal(got, want), f"layer {layer} differs"


def publish_layout(client, full, tokens_ids, T, H, axes, ns, block=BLOCK, salt=""):
    rng = np.random.default_rng(T)
    new = []
    for r in range(T):
        cache, ids, _ = rank_cache(full, shard_heads(r, T, H), axes, block, rng)
        pc = PrefixCache(
            client,
            namespace=ns,
            block_size=block,
            cache_salt=salt,
            tp_rank=r,
            tp_size=T,
            total_kv_heads=H,
        )
        new.append(pc.publish_kv(tokens_ids, cache, ids))
    return new


def reuse(
    client,
    full,
    prompt_ids,
    T,
    H,
    axes,
    ns,
    *,
    block=BLOCK,
    peers=(),
    salt="",
    source=None,
    per_buffer=False,
):
    """Every TP rank of a DP rank matches and loads; returns [(match facts, rank bits ok)]."""
    rng = np.random.default_rng(100 + T)
    out = []
    for r in range(T):
        mine = shard_heads(r, T, H)
        cache, ids, bits = rank_cache(np.zeros_like(full), mine, axes, block, rng, fill=False)
        pc = PrefixCache(
            client,
            namespace=ns,
            block_size=block,
            cache_salt=salt,
            tp_rank=r,
            tp_size=T,
            total_kv_heads=H,
            peer_tp_sizes=peers,
        )
        with pc.match_kv(prompt_ids, source_tp_size=source) as m:
            if per_buffer:  # as if the buffers were not back to back: one copy per buffer
                m._starts = lambda *a, resolve=m._starts: (resolve(*a)[0], None)
            ops = m.load(cache, ids)
            copies = m.num_blocks * full.shape[0] * len(m.ranks)  # K+V in one copy
            assert ops == copies * (2 if per_buffer else 1)
            assert_loaded(full, mine, axes, bits, ids, block, m.num_tokens)
            out.append((m.num_tokens, m.source_tp_size, list(m.ranks)))
    return out


def test_two_dp_ranks_with_tp2_reuse_shard_wise(tp_daemon):
    H, T, layers, dim, ns = 8, 2, 3, 16, f"tp{next(_namespaces)}"
    tokens = prompt(6 * BLOCK, 21)
    full = full_kv(21, layers, len(tokens), H, dim)
    with tp_daemon.client(name="dp0") as c0, tp_daemon.client(name="dp1") as c1:
        assert publish_layout(c0, full, tokens, T, H, KV_LAYOUTS["NHD"], ns) == [6, 6]
        # DP rank 1 shares the first 4 blocks; its own cache pages them as HND.
        p1 = tokens[: 4 * BLOCK] + prompt(3 * BLOCK, 22)
        got = reuse(c1, full, p1, T, H, KV_LAYOUTS["HND"], ns)
        assert got == [(4 * BLOCK, T, [0]), (4 * BLOCK, T, [1])]  # each rank: its own shard
        # Publishing the same prompt again (DP rank 1 after its prefill) copies nothing.
        assert publish_layout(c1, full, tokens, T, H, KV_LAYOUTS["HND"], ns) == [0, 0]
        keys = {o.key for o in c1.list(namespace=ns)}
        hashes = block_hashes(tokens, BLOCK, namespace=ns)
        assert keys == {shard_block_key(h, r, T, H) for h in hashes for r in range(T)}


@pytest.mark.parametrize(
    "H,src,dst", [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 8), (4, 8, 2), (2, 4, 1), (40, 8, 4)]
)
def test_a_different_tp_layout_reuses_through_resharding(tp_daemon, H, src, dst):
    layers, dim, ns = 2, 8, f"tp{next(_namespaces)}"
    tokens = prompt(5 * BLOCK + 3, H * 100 + src * 10 + dst)
    full = full_kv(H + src + dst, layers, len(tokens), H, dim)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, src, H, KV_LAYOUTS["NHD"], ns)
        got = reuse(c, full, tokens, dst, H, KV_LAYOUTS["HND"], ns, peers=(src,))
    for d, (n, source, ranks) in enumerate(got):
        assert n == 5 * BLOCK and source == src  # own layout (dst) has nothing: peers tried
        need = set(shard_heads(d, dst, H))
        want = {p for p in range(src) if set(shard_heads(p, src, H)) & need}
        copies = len(want) if src <= H else len(shard_heads(d, dst, H))  # one copy per head
        assert len(ranks) == copies and set(ranks) <= set(want)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    H=st.sampled_from([1, 2, 4, 8]),
    src=st.sampled_from([1, 2, 4, 8]),
    dst=st.sampled_from([1, 2, 4, 8]),
    a=st.sampled_from(sorted(KV_LAYOUTS)),
    b=st.sampled_from(sorted(KV_LAYOUTS)),
    block=st.sampled_from([1, 4, 16]),
    n=st.integers(2, 40),
    seed=st.integers(0, 2**31),
)
def test_resharded_prefix_is_bit_exact(tp_daemon, H, src, dst, a, b, block, n, seed):
    ns = f"tp{next(_namespaces)}"
    tokens = prompt(n, seed)
    full = full_kv(seed, 2, n, H, 4)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, src, H, KV_LAYOUTS[a], ns, block=block)
        got = reuse(c, full, tokens, dst, H, KV_LAYOUTS[b], ns, block=block, source=src)
        c.evict(namespace=ns)
    assert {g[0] for g in got} == {(n - 1) // block * block}


def test_shard_keys_never_collide_and_salts_isolate(tp_daemon):
    h = block_hashes(prompt(16, 1), 16)[0]
    keys = {shard_block_key(h, r, t, H) for H in (4, 8) for t in (1, 2, 4) for r in range(t)}
    assert len(keys) == 2 * (1 + 2 + 4)
    H, ns = 4, f"tp{next(_namespaces)}"
    tokens = prompt(4 * BLOCK, 31)
    full = full_kv(31, 1, len(tokens), H, 8)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, 2, H, KV_LAYOUTS["NHD"], ns, salt="tenant-a")
        for salt, other_ns in (("tenant-b", ns), ("", ns), ("tenant-a", ns + "x")):
            for T in (1, 2):
                pc = PrefixCache(
                    c,
                    namespace=other_ns,
                    block_size=BLOCK,
                    cache_salt=salt,
                    tp_rank=0,
                    tp_size=T,
                    total_kv_heads=H,
                    peer_tp_sizes=(1, 2),
                )
                with pc.match_kv(tokens + [0]) as m:
                    assert m.num_tokens == 0
        assert [
            g[0]
            for g in reuse(
                c, full, tokens + [0], 1, H, KV_LAYOUTS["NHD"], ns, peers=(2,), salt="tenant-a"
            )
        ] == [4 * BLOCK]


def test_partial_availability_returns_the_common_length(tp_daemon):
    H, ns = 4, f"tp{next(_namespaces)}"
    tokens = prompt(6 * BLOCK + 1, 41)
    full = full_kv(41, 2, len(tokens), H, 8)
    hashes = block_hashes(tokens, BLOCK, namespace=ns)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, 2, H, KV_LAYOUTS["NHD"], ns)
        for b in (5, 4):  # TP rank 1 lost its last two blocks (leaf first)
            assert c.evict(key=shard_block_key(hashes[b], 1, 2, H), namespace=ns).count == 1
        # A TP=1 rank needs both shards: it gets the 4 blocks both hold, never 6.
        got = reuse(c, full, tokens, 1, H, KV_LAYOUTS["HND"], ns, source=2)
        assert got == [(4 * BLOCK, 2, [0, 1])]
        # Same layout: each rank reads its own shard; the ranks see 6 and 4 blocks and the DP
        # rank loads the minimum in both.
        lengths = []
        for r in range(2):
            pc = PrefixCache(
                c, namespace=ns, block_size=BLOCK, tp_rank=r, tp_size=2, total_kv_heads=H
            )
            with pc.match_kv(tokens) as m:
                lengths.append(m.num_blocks)
                cache, ids, bits = rank_cache(
                    np.zeros_like(full),
                    shard_heads(r, 2, H),
                    KV_LAYOUTS["NHD"],
                    BLOCK,
                    np.random.default_rng(r),
                    fill=False,
                )
                assert m.load(cache, ids, num_blocks=4) == 4 * 2  # blocks x layers
                assert_loaded(
                    full, shard_heads(r, 2, H), KV_LAYOUTS["NHD"], bits, ids, BLOCK, 4 * BLOCK
                )
        assert lengths == [6, 4]
        # Rank 0's shard gone (a chain goes leaf first, so all of it): nothing is common,
        # even though rank 1 still holds 4 blocks.
        assert c.evict(match=r"\.tp0of2$", namespace=ns).count == 6
        assert reuse(c, full, tokens, 1, H, KV_LAYOUTS["HND"], ns, source=2) == [(0, 2, [0, 1])]


def test_kv_match_errors_are_clear(tp_daemon):
    H, ns = 4, f"tp{next(_namespaces)}"
    tokens = prompt(3 * BLOCK + 1, 51)
    full = full_kv(51, 2, len(tokens), H, 8)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, 1, H, KV_LAYOUTS["NHD"], ns)
        pc = PrefixCache(c, namespace=ns, block_size=BLOCK, total_kv_heads=H)
        rng = np.random.default_rng(0)
        with pc.match_kv(tokens) as m:
            assert m.num_blocks == 3
            wrong_dim, ids, _ = rank_cache(
                full_kv(0, 2, len(tokens), H, 4), range(H), KV_LAYOUTS["NHD"], BLOCK, rng
            )
            with pytest.raises(LayoutMismatch, match="head_dim"):
                m.load(wrong_dim, ids)
            wrong_layers, ids, _ = rank_cache(
                full_kv(0, 3, len(tokens), H, 8), range(H), KV_LAYOUTS["NHD"], BLOCK, rng
            )
            with pytest.raises(LayoutMismatch, match="layers"):
                m.load(wrong_layers, ids)
            with pytest.raises(BadRequest, match="num_blocks"):
                m.load(wrong_layers, ids, num_blocks=4)
        good, ids, _ = rank_cache(full, range(H), KV_LAYOUTS["NHD"], BLOCK, rng)
        with pytest.raises(KVBrokerError, match="released"):
            m.load(good, ids)
        with pytest.raises(BadRequest, match="total_kv_heads"):
            PrefixCache(c, namespace=ns, block_size=BLOCK).match_kv(tokens)
        with pytest.raises(BadRequest):
            PrefixCache(c, tp_rank=2, tp_size=2, total_kv_heads=H)
        with pytest.raises(LayoutMismatch, match="block size"):
            PrefixCache(c, namespace=ns, block_size=8, total_kv_heads=H).publish_kv(
                tokens, good, ids
            )


@pytest.mark.parametrize("src,dst", [(1, 1), (2, 1), (1, 4)])
def test_per_buffer_copies_when_buffers_are_not_back_to_back(tp_daemon, src, dst):
    H, ns = 4, f"tp{next(_namespaces)}"
    tokens = prompt(3 * BLOCK + 5, 61)
    full = full_kv(61, 3, len(tokens), H, 8)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, src, H, KV_LAYOUTS["HND"], ns)
        got = reuse(c, full, tokens, dst, H, KV_LAYOUTS["NHD"], ns, source=src, per_buffer=True)
    assert [g[0] for g in got] == [3 * BLOCK] * dst


@pytest.mark.parametrize("src,per_buffer", [(1, False), (1, True), (2, False)])
def test_whole_row_copies_are_exact(tp_daemon, src, per_buffer):
    # 8 heads x head_dim 128 x 2 bytes = 2 KiB NHD rows: big enough to copy in row order.
    H, ns = 8, f"tp{next(_namespaces)}"
    tokens = prompt(3 * BLOCK + 1, 71)
    full = full_kv(71, 2, len(tokens), H, 128)
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, src, H, KV_LAYOUTS["NHD"], ns)
        got = reuse(c, full, tokens, 1, H, KV_LAYOUTS["NHD"], ns, source=src, per_buffer=per_buffer)
    assert got == [(3 * BLOCK, src, list(range(src)))]


def _tp_rank_process(sock, ns, role, r, T, H, seed, queue):
    """One TP rank of a DP rank in its own process: "prefill" publishes its shard of the
    4-block prompt; "reuse" matches a prompt sharing 3 blocks and loads its heads."""
    try:
        tokens = prompt(4 * BLOCK, seed)
        full = full_kv(seed, 2, len(tokens), H, 16)
        rng = np.random.default_rng(seed + 10 * r + (role == "reuse"))
        mine = shard_heads(r, T, H)
        with Client(sock, name=f"{role}{r}") as c:
            pc = PrefixCache(
                c, namespace=ns, block_size=BLOCK, tp_rank=r, tp_size=T, total_kv_heads=H
            )
            if role == "prefill":
                cache, ids, _ = rank_cache(full, mine, KV_LAYOUTS["NHD"], BLOCK, rng)
                queue.put((role, r, pc.publish_kv(tokens, cache, ids)))
                return
            cache, ids, bits = rank_cache(
                np.zeros_like(full), mine, KV_LAYOUTS["HND"], BLOCK, rng, fill=False
            )
            with pc.match_kv(tokens[: 3 * BLOCK] + prompt(2 * BLOCK, seed + 1)) as m:
                m.load(cache, ids)
                assert_loaded(full, mine, KV_LAYOUTS["HND"], bits, ids, BLOCK, m.num_tokens)
                queue.put((role, r, (m.num_tokens, m.ranks)))
    except Exception as exc:  # reported to the test, which fails on it
        queue.put((role, r, repr(exc)))


def test_dp_rank_processes_with_tp2_reuse_shard_wise(tp_daemon):
    ns, T, H, seed = f"tp{next(_namespaces)}", 2, 4, 81
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    for role in ("prefill", "reuse"):
        procs = [
            ctx.Process(
                target=_tp_rank_process,
                args=(tp_daemon.socket_path, ns, role, r, T, H, seed, queue),
            )
            for r in range(T)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        got = sorted(queue.get(timeout=5) for _ in range(T))
        if role == "prefill":
            assert got == [("prefill", 0, 4), ("prefill", 1, 4)]
        else:  # each TP rank of the second DP rank read its own TP rank's shard, bytes equal
            assert got == [("reuse", 0, (3 * BLOCK, [0])), ("reuse", 1, (3 * BLOCK, [1]))]


def _decode_rank_over(c, seed, blocks, prefill_tp):
    """A 4-block prompt whose first ``blocks`` blocks a TP=``prefill_tp`` prefill published
    (4 KV heads); returns it and the PrefixCache of a TP=1 decode rank that also reads TP=2."""
    H, ns = 4, f"tp{next(_namespaces)}"
    tokens = prompt(4 * BLOCK, seed)
    head = tokens[: blocks * BLOCK]
    publish_layout(c, full_kv(seed, 1, len(head), H, 8), head, prefill_tp, H, KV_LAYOUTS["NHD"], ns)
    return tokens, PrefixCache(
        c,
        namespace=ns,
        block_size=BLOCK,
        tp_rank=0,
        tp_size=1,
        total_kv_heads=H,
        peer_tp_sizes=(2,),
    )


def test_match_kv_releases_the_best_match_when_a_later_layout_fails(tp_daemon, monkeypatch):
    with tp_daemon.client() as c:
        # TP=1 shards of the first 2 of 4 blocks: the TP=2 layout is tried next
        tokens, pc = _decode_rank_over(c, 51, 2, 1)
        from kvbroker._client import block_match as blocks

        real, calls = blocks._match_layout, []

        def flaky(client, namespace, hashes, block_size, source, *rest):
            calls.append(source)
            if source == 2:
                raise BrokerUnavailable("the daemon went away mid-match")
            found = real(client, namespace, hashes, block_size, source, *rest)
            assert found.num_blocks == 2
            return found

        monkeypatch.setattr(blocks, "_match_layout", flaky)
        with pytest.raises(BrokerUnavailable):
            pc.match_kv(tokens + [0])
        assert calls == [1, 2]
        assert c.stat().read_leases == 0  # the first layout's lease was not left to its TTL


def test_a_match_kv_that_holds_nothing_counts_what_a_held_one_reads(tp_daemon):
    # A decode rank of TP=1 over a TP=2 prefill's shards (two keys per block): hold=False
    # counts the blocks both shards hold, takes no lease, and has nothing to read.
    with tp_daemon.client() as c:
        tokens, pc = _decode_rank_over(c, 53, 3, 2)
        out_before = c.stat().counters.bytes_out
        counted = pc.match_kv(tokens + [0], hold=False)
        assert (counted.num_blocks, counted.lease, counted.released) == (3, None, True)
        with pytest.raises(KVBrokerError, match="hold=False"):
            _ = counted.blocks
        with pytest.raises(KVBrokerError, match="hold=False"):
            counted.load(None, [])
        with pytest.raises(BadRequest, match="peer needs hold"):  # never a lease it would keep
            pc.match(tokens, hold=False, peer="127.0.0.1:9")
        stat = c.stat()
        assert stat.read_leases == 0 and stat.counters.bytes_out == out_before
        with pc.match_kv(tokens + [0]) as held:
            assert held.num_blocks == counted.num_blocks and held.lease is not None
        assert pc.match(tokens, hold=False).num_blocks == 0  # TP=1 keys: none published


def test_a_match_over_1024_blocks_of_64_buffers_fits_one_reply(client):
    """A 16k-token prompt of a 32-layer model in 16-token blocks: the match reply's packed
    extents (1,032 bytes a block) are just over 1 MiB, which a 1 MiB binary limit refused."""
    from kvbroker.prefix import PrefixCache

    pc = PrefixCache(client, namespace="bigmatch", block_size=16)
    tokens = list(range(1024 * 16 + 1))
    names = [f"past_{kind}.{i}" for i in range(32) for kind in ("key", "value")]
    blocks = [{n: b"" for n in names} for _ in range(1024)]
    pc.publish(tokens, blocks)
    with pc.match(tokens) as m:
        assert m.num_blocks == 1024
        assert len(m.blocks) == 1024 and set(m.blocks[0]) == set(names)


@pytest.mark.parametrize("per_buffer", [False, True])
@pytest.mark.parametrize("axes", ["NHD", "HND"])
def test_a_big_load_copies_on_the_engines_threads(tp_daemon, monkeypatch, axes, per_buffer):
    """A matched prefix loads one layer per job over the copy engine's threads, bit-exact
    (reuse() checks every loaded token), whichever copy loop runs."""
    import threading

    from kvbroker._client import engine as _engine

    engine = _engine.CopyEngine(threads=4)
    ran_on = set()

    def run_jobs(jobs, nbytes, _real=engine.run_jobs):
        def spied(job):
            ran_on.add(threading.get_ident())
            return job()

        return _real([lambda job=job: spied(job) for job in jobs], nbytes)

    monkeypatch.setattr(engine, "run_jobs", run_jobs)
    monkeypatch.setattr(_engine, "_default", engine)
    H, ns = 8, f"tp{next(_namespaces)}"
    tokens = prompt(32 * BLOCK + 3, 81)
    full = full_kv(81, 16, len(tokens), H, 128)  # 16 layers of 512 tokens: 16 MiB to load
    with tp_daemon.client() as c:
        publish_layout(c, full, tokens, 2, H, KV_LAYOUTS["HND"], ns)
        try:
            got = reuse(
                c, full, tokens, 1, H, KV_LAYOUTS[axes], ns, source=2, per_buffer=per_buffer
            )
        finally:
            c.evict(namespace=ns, all=True)  # 16 MiB of this module's 64 MiB pool
    assert got == [(32 * BLOCK, 2, [0, 1])]
    assert len(ran_on) > 1
