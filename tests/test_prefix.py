"""Prefix reuse across DP ranks: chained hashes, longest-prefix match, isolation, eviction."""

import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest

from kvbroker import Client
from kvbroker.prefix import PrefixCache, block_hashes

BLOCK = 16
LAYERS = 2
BLOCK_BYTES = BLOCK * 2 * 8 * 4  # tokens x (k,v) x heads x head_dim... of uint8


def kv_block(tokens, layer):
    """Deterministic per-block KV that depends on the whole prefix, like real attention KV."""
    seed = int(np.sum(np.asarray(tokens, dtype=np.int64) * np.arange(1, len(tokens) + 1)) % 2**32)
    return np.random.default_rng([seed, layer]).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def blocks_for(tokens):
    return [
        {f"past_key.{l}": kv_block(tokens[: (b + 1) * BLOCK], l) for l in range(LAYERS)}
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
    assert all(a != b for a, b in zip(h, h2))
    assert block_hashes(toks[:50], BLOCK, namespace="ns", cache_salt="s") == h[:3]
    assert block_hashes(toks, BLOCK, namespace="ns", cache_salt="t") != h
    assert block_hashes(toks, BLOCK, namespace="other", cache_salt="s") != h
    code = ("from kvbroker.prefix import block_hashes; import sys;"
            f"print(','.join(block_hashes({toks!r}, {BLOCK}, namespace='ns', cache_salt='s')))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
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
                for l in range(LAYERS):
                    assert np.array_equal(blk[f"past_key.{l}"], want[b][f"past_key.{l}"])
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
    for pc in (PrefixCache(client, block_size=BLOCK, cache_salt="tenant-b"),
               PrefixCache(client, block_size=BLOCK, cache_salt=""),
               PrefixCache(client, block_size=BLOCK, cache_salt="tenant-a", namespace="x")):
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

    sizes = {f"past_key.{l}": BLOCK_BYTES for l in range(LAYERS)}
    assert pc.publish(toks, block, block_sizes=sizes) == 3
    assert asked == [3, 4, 5]


def test_eviction_is_leaf_first_and_never_under_a_reader(make_daemon):
    # 12 pages of 4 KiB; every block object takes one page
    d = make_daemon("--pool-size", "48K", "--page-size", "4K", "--high-watermark", "1.0",
                    "--low-watermark", "1.0")
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
    procs = [ctx.Process(target=_matcher, args=(d.socket_path, shared, 200, errors)) for _ in range(2)]
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
