"""The public block API (kvbroker.blocks) against a real daemon: reserve, views, seal with
checksums, abort (also on a dead connection), extents of a match, and the formats' sizes."""

from __future__ import annotations

import numpy as np
import pytest

from kvbroker import blocks
from kvbroker.errors import BadRequest, ChecksumMismatch, LayoutMismatch, PoolFull
from kvbroker.kv import PagedKV
from kvbroker.prefix import PrefixCache, block_hashes

NS = "blk"


@pytest.fixture
def bare(daemon):
    """A client without a write arena: every page the pool lends is a block's."""
    with daemon.client(arena_size=0) as c:
        yield c


def chain(n: int) -> list[dict]:
    keys = [f"b{i}" for i in range(n)]
    return [{"key": k, "parent": keys[i - 1] if i else None} for i, k in enumerate(keys)]


def fill(rng, reservation: blocks.Reservation, name: str) -> list[np.ndarray]:
    """Random bytes into buffer ``name`` of every reserved block; returns what was written."""
    out = []
    for j in range(len(reservation)):
        data = rng.integers(0, 256, reservation.extents(j)[name][2], dtype=np.uint8)
        reservation.view(j, name)[:] = data
        out.append(data)
    return out


# -- formats --------------------------------------------------------------------------------
def test_attention_format_sizes_names_and_the_meta_published_blocks_carry():
    fmt = blocks.AttentionFormat.for_rank(
        dtype="bfloat16",
        num_layers=3,
        block_size=16,
        head_dim=64,
        total_kv_heads=8,
        tp_rank=1,
        tp_size=4,
    )
    assert (fmt.local_heads, fmt.heads) == (2, (2, 4))
    assert fmt.buffer_nbytes == 2 * 16 * 64 * 2
    assert fmt.block_nbytes == 3 * 2 * fmt.buffer_nbytes
    assert fmt.buffers() == {"kv": fmt.block_nbytes}
    assert fmt.flat_names[:3] == ["past_key.0", "past_value.0", "past_key.1"]
    assert fmt.offset_of(1, 1) == 3 * fmt.buffer_nbytes
    assert fmt.key("abc") == "abc/h8.tp1of4"
    # the meta the vLLM connector's blocks were always published with: they still load
    assert fmt.meta() == {
        "kvbroker.prefix.kv": 1,
        "tp_rank": 1,
        "tp_size": 4,
        "total_kv_heads": 8,
        "heads": [2, 4],
        "num_layers": 3,
        "components": ["key", "value"],
        "infix": None,
        "layout": fmt.buffer_layout.to_dict(),
        "packed": "kv",
    }
    named = blocks.AttentionFormat.for_rank(
        dtype="bfloat16",
        num_layers=3,
        block_size=16,
        head_dim=64,
        total_kv_heads=8,
        tp_rank=1,
        tp_size=4,
        packed=None,
    )
    assert named.buffers() == dict.fromkeys(fmt.flat_names, fmt.buffer_nbytes)
    assert "packed" not in named.meta()
    assert fmt.check(named.meta()).nbytes == fmt.buffer_nbytes  # either form loads
    other = blocks.AttentionFormat.for_rank(
        dtype="float16", num_layers=3, block_size=16, head_dim=64, total_kv_heads=8
    )
    with pytest.raises(LayoutMismatch, match="dtype"):
        fmt.check(other.meta())
    mla = blocks.AttentionFormat.for_rank(
        dtype="float16",
        num_layers=2,
        block_size=4,
        head_dim=576,
        total_kv_heads=None,
        tp_rank=3,
        tp_size=4,
    )
    assert (mla.components, mla.local_heads, mla.key("h")) == (("latent",), 1, "h/h0.tp3of4")
    assert mla.block_nbytes == 2 * 4 * 576 * 2
    with pytest.raises(BadRequest):
        blocks.AttentionFormat.for_rank(
            dtype="nope", num_layers=1, block_size=1, head_dim=1, total_kv_heads=1
        )


def test_a_sliding_window_format_is_the_same_bytes_and_names_the_reachable_blocks():
    full = blocks.AttentionFormat.for_rank(
        dtype="float16", num_layers=2, block_size=16, head_dim=8, total_kv_heads=2
    )
    sliding = blocks.AttentionFormat.for_rank(
        dtype="float16", num_layers=2, block_size=16, head_dim=8, total_kv_heads=2, window=32
    )
    assert (sliding.buffers(), sliding.meta()) == (full.buffers(), full.meta())
    assert full.reachable(200) == range(13)
    # 200 tokens, a window of 32: tokens 169.. are read, blocks 10..12 (vLLM's rule)
    assert sliding.reachable(200) == range(10, 13)
    assert sliding.reachable(20) == range(0, 2)
    with pytest.raises(BadRequest):
        blocks.AttentionFormat.for_rank(
            dtype="float16", num_layers=2, block_size=16, head_dim=8, total_kv_heads=2, window=0
        )


def test_state_format_sizes_offsets_and_checks():
    fmt = blocks.StateFormat(
        (
            blocks.StateBuffer("conv.0", "bfloat16", (3, 128)),
            blocks.StateBuffer("ssm.0", "float32", (4, 16, 8)),
        ),
        tp_rank=1,
        tp_size=2,
    )
    assert fmt.block_nbytes == 3 * 128 * 2 + 4 * 16 * 8 * 4
    assert fmt.offset_of("ssm.0") == 3 * 128 * 2
    assert fmt.buffers() == {"state": fmt.block_nbytes}
    assert fmt.key("abc") == "abc/state.tp1of2"
    fmt.check(fmt.meta())
    other = blocks.StateFormat(
        (blocks.StateBuffer("conv.0", "bfloat16", (3, 128)),), tp_rank=0, tp_size=2
    )
    with pytest.raises(LayoutMismatch, match="parts"):
        fmt.check(other.meta())
    with pytest.raises(LayoutMismatch, match="not state pages"):
        fmt.check(
            blocks.AttentionFormat.for_rank(
                dtype="float16", num_layers=1, block_size=1, head_dim=1, total_kv_heads=1
            ).meta()
        )
    with pytest.raises(BadRequest):
        blocks.StateFormat((blocks.StateBuffer("a", "float32", (1,)),) * 2)


# -- writers --------------------------------------------------------------------------------
def test_reserve_write_seal_and_the_checksums_are_verified_on_claim(bare):
    rng = np.random.default_rng(1)
    res = blocks.reserve(bare, NS, chain(3), {"kv": 5000, "extra": 7}, {"m": 1})
    assert len(res) == 3 and len(res.taken) == 3 and res.names == ["kv", "extra"]
    assert bare.stat().write_leases == 3
    kind = bare.checksum_kind
    data = fill(rng, res, "kv")
    sums = [
        {
            "kv": blocks.checksum(res.view(j, "kv"), kind),
            "extra": blocks.copy(res.view(j, "extra"), np.arange(7, dtype=np.uint8), kind),
        }
        for j in range(3)
    ]
    assert sums == res.checksums()  # hashed now, over the engine's threads: the same
    where = res.extents(1)["kv"]
    res.seal(sums)
    assert bare.stat().write_leases == 0
    for j, key in enumerate(["b0", "b1", "b2"]):
        with bare.claim(key, namespace=NS, verify=True, consume=False) as lease:
            assert bytes(lease["kv"]) == data[j].tobytes()
            assert bytes(lease["extra"]) == bytes(range(7))
            assert lease.meta == {"m": 1}
    # the same blocks again: the node holds them, nothing is reserved
    again = blocks.reserve(bare, NS, chain(3), {"kv": 5000, "extra": 7})
    assert again.leases == [None] * 3 and len(again) == 0 and again.taken == []
    # a byte changed under the broker: the recorded checksum catches it on claim
    pool, offset, _ = where
    bare.pool_view(pool, offset, 1, writable=True)[0] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        bare.claim("b1", namespace=NS, verify=True, consume=False)


def test_a_refused_batch_holds_nothing_and_abort_frees_the_pages(bare):
    used = bare.stat().pools[0].used
    with pytest.raises(PoolFull):  # 64 MiB pool: the 9th block cannot fit
        blocks.reserve(bare, NS, chain(9), {"kv": 8 << 20})
    stat = bare.stat()
    assert (stat.write_leases, stat.pending, stat.pools[0].used) == (0, 0, used)
    res = blocks.reserve(bare, NS, chain(4), {"kv": 1 << 20})
    assert bare.stat().pending == 4
    res.abort()
    stat = bare.stat()  # the aborts were pipelined: this call reads their replies first
    assert (stat.write_leases, stat.pending, stat.objects, stat.pools[0].used) == (0, 0, 0, used)
    assert not bare.exists("b0", namespace=NS)


def test_pipelined_reserve_and_seal(bare):
    later = [
        blocks.reserve_later(bare, NS, chain(2), {"kv": 4096}),
        blocks.reserve_later(bare, NS, [{"key": "x", "parent": None}], {"kv": 4096}),
    ]
    res = later[0].result() + later[1].result()
    assert len(res) == 3 and res.names == ["kv"]
    fill(np.random.default_rng(2), res, "kv")
    blocks.seal_later(bare, res.taken, res.checksums()).result()
    assert {o.key for o in bare.list(namespace=NS)} == {"b0", "b1", "x"}
    with bare.claim("x", namespace=NS, verify=True, consume=False):
        pass


def test_blocks_of_differing_buffers_in_one_batch(bare):
    request = [
        {"key": "a", "parent": None, "buffers": {"k": 10}},
        {"key": "b", "parent": "a", "buffers": {"k": 10, "v": 20}},
    ]
    res = blocks.reserve(bare, NS, request)
    assert res.rows is None and res.extents(1)["v"][2] == 20
    res.view(1, "v")[:] = 9
    res.seal()
    with bare.claim("b", namespace=NS, consume=False) as lease:
        assert bytes(lease["v"]) == b"\x09" * 20
    with pytest.raises(LayoutMismatch):
        res.runs(["k"], 10, {}, 0, 10)


def test_pool_runs_merge_neighbours_on_both_sides(bare):
    res = blocks.reserve(bare, NS, chain(4), {"a": 4096, "b": 4096})
    base = bare.pool_address(0)
    runs = res.runs(["a", "b"], 4096, {0: base}, stage=1 << 40, stride=8192)
    # laid back to back in the pool and in the staging: runs cover every byte once
    assert sum(n for _, _, n in runs) == 4 * 8192
    assert len(runs) < 8
    pool, offset, _ = res.extents(0)["a"]
    assert runs[0][:2] == (base + offset, 1 << 40)
    # what the address says is what a view sees
    import ctypes

    res.view(2, "b")[:3] = [7, 8, 9]
    _, off_b, _ = res.extents(2)["b"]
    assert ctypes.string_at(base + off_b, 3) == b"\x07\x08\x09"
    res.abort()


def test_abort_on_a_dead_connection_neither_sends_nor_reconnects(make_daemon):
    d = make_daemon("--pool-size", "16M", "--page-size", "4K")
    c = d.client(arena_size=0, reconnect=0.2)
    try:
        res = blocks.reserve(c, NS, chain(2), {"kv": 4096})
        assert c.connected
        d.stop()
        with pytest.raises(Exception):  # noqa: B017 - the break, as any call meets it
            c.ping()
        assert not c.connected
        # a new daemon on the same socket: a client that sent the aborts would reconnect
        # to it (waiting up to `reconnect` seconds while it was down) for leases long gone
        d2 = make_daemon("--pool-size", "16M", "--page-size", "4K")
        c.socket_path = d2.socket_path
        c.reconnect = 30
        generation = c.generation
        blocks.abort(c, res.taken)
        assert (c.generation, c.connected) == (generation, False)
        with d2.client(map_pools=False) as probe:
            assert len(probe.stat().clients) == 1  # only the probe itself
    finally:
        c.close()
    assert not c.connected


# -- readers --------------------------------------------------------------------------------
def test_match_hands_out_extents_and_views_under_one_read_lease(bare):
    fmt = blocks.AttentionFormat.for_rank(
        dtype="float16", num_layers=2, block_size=4, head_dim=8, total_kv_heads=2
    )
    hashes = block_hashes(list(range(13)), 4, namespace=NS)
    request = [
        {"key": fmt.key(h), "parent": fmt.key(hashes[i - 1]) if i else None}
        for i, h in enumerate(hashes[:2])
    ]
    res = blocks.reserve(bare, NS, request, fmt.buffers(), fmt.meta())
    data = fill(np.random.default_rng(3), res, "kv")
    res.seal(res.checksums())
    with blocks.match(bare, NS, fmt, hashes) as m:
        assert m.num_blocks == 2 and bare.stat().read_leases == 1
        names, rows = m.extents()
        assert names == ["kv"] and rows.shape == (2, 3)
        for j in range(2):
            pool, offset, nbytes = (int(v) for v in rows[j])
            assert bytes(bare.pool_view(pool, offset, nbytes)) == data[j].tobytes()
            view = m.blocks[j]["kv"]
            assert bytes(view) == data[j].tobytes() and not view.flags.writeable
    assert bare.stat().read_leases == 0
    counted = blocks.match(bare, NS, fmt, hashes, hold=False)
    assert (counted.num_blocks, counted.lease) == (2, None)


def test_a_block_the_api_wrote_loads_through_match_kv_bit_for_bit(bare):
    # The packed form the vLLM connector writes and PrefixCache.publish_kv's named form are
    # the same bytes: a PagedKV loads both.
    rng = np.random.default_rng(4)
    layers, bs, heads, dim = 2, 4, 2, 8
    src = rng.integers(0, 1 << 16, (layers, 2, 3, bs, heads, dim), dtype=np.uint16)
    fmt = blocks.AttentionFormat.for_rank(
        dtype="uint16", num_layers=layers, block_size=bs, head_dim=dim, total_kv_heads=heads
    )
    tokens = list(range(3 * bs + 1))
    hashes = block_hashes(tokens, bs, namespace=NS)
    request = [
        {"key": fmt.key(h), "parent": fmt.key(hashes[i - 1]) if i else None}
        for i, h in enumerate(hashes)
    ]
    res = blocks.reserve(bare, NS, request, fmt.buffers(), fmt.meta())
    for j in range(3):
        for layer in range(layers):
            for c in range(2):
                dst = res.view(j, "kv", fmt.offset_of(layer, c), fmt.buffer_nbytes)
                blocks.copy(dst, src[layer, c, j].transpose(1, 0, 2))  # [head][token][dim]
    res.seal(res.checksums())
    out = np.zeros_like(src)
    cache = PagedKV(
        [out[layer] for layer in range(layers)], ("kv", "block", "token", "head", "head_dim")
    )
    pc = PrefixCache(bare, namespace=NS, block_size=bs, total_kv_heads=heads)
    with pc.match_kv(tokens) as m:
        assert m.load(cache, [0, 1, 2]) > 0
    assert np.array_equal(out, src)
