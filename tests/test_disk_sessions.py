"""Sessions beside the disk tier ([tier.disk], issue 42: "retained sessions first to stay in
DRAM"): under pressure the pools demote every unretained object to disk before a session's
retained blocks; released, those blocks go to disk with the next overflow and are still
served from there."""

from __future__ import annotations

import time

from kvbroker.prefix import PrefixCache
from test_disk_daemon import daemons, tier_env, wait_for  # noqa: F401 (a fixture)

BS = 16
BLOCK = 64 << 10


def _conversation(pc: PrefixCache, first: int, nblocks: int, **kw) -> list[int]:
    tokens = list(range(first, first + nblocks * BS + 1))
    pc.publish(tokens, lambda i: {"kv": bytes([i]) * BLOCK}, block_sizes={"kv": BLOCK}, **kw)
    return tokens


def _overflow(c, n: int = 80) -> None:
    """One-shot objects: more than the whole pool (4 MiB)."""
    for i in range(n):
        c.put(f"oneshot-{i}-{time.monotonic_ns()}", {"x": bytes(BLOCK)})


def test_unretained_objects_go_to_disk_before_a_sessions_blocks(daemons, tmp_path):  # noqa: F811
    # No write-back ahead of eviction (watermark 1): what reaches the disk is what the pools
    # demoted, in their order.
    d = daemons(tier_env(tmp_path / "disk", writeback_watermark="1"))
    with d.client() as c:
        pc = PrefixCache(c, namespace="chat", block_size=BS, checksum=False)
        kept = _conversation(pc, 0, 8, session="conv-1", retain="30m")
        plain = _conversation(pc, 100_000, 8)
        kept_keys = set(pc.keys(pc.hashes(kept)))
        plain_keys = set(pc.keys(pc.hashes(plain)))
        _overflow(c)

        tiers = {o.key: o.tier for o in c.list(namespace="chat")}
        assert {tiers[k] for k in kept_keys} <= {"dram", "dram+disk"}, tiers  # in a pool
        assert {tiers[k] for k in plain_keys} == {"disk"}, tiers  # demoted, not dropped
        st = c.stat()
        assert st.disk.demoted >= 8 + 1 and st.retention.evicted == {}
        assert pc.match(plain, hold=False).num_blocks == 8  # still served, from disk

        # Released, the session's blocks are plain LRU: the next overflow demotes them.
        c.ops.unretain("conv-1", namespace="chat")
        _overflow(c)
        tiers = {o.key: o.tier for o in c.list(namespace="chat")}
        assert {tiers[k] for k in kept_keys} == {"disk"}, tiers
        with pc.match(kept) as m:  # promoted back, bit-exact
            assert m.num_blocks == 8
            for i, blk in enumerate(m.blocks):
                assert bytes(blk["kv"]) == bytes([i]) * BLOCK, i


def test_policy_sealed_writes_every_block_a_chains_parents_and_a_sessions_too(
    daemons,  # noqa: F811
    tmp_path,
):
    """Policy sealed writes every object sealed, so that all of the pools survive a reboot:
    the parents of a prefix chain (never in the LRU while they have children) and a
    session's retained blocks (out of the LRU) as well as the leaves."""
    d = daemons(tier_env(tmp_path / "disk", policy="sealed"))
    with d.client() as c:
        pc = PrefixCache(c, namespace="chat", block_size=BS, checksum=False)
        kept = _conversation(pc, 0, 4, session="conv-2", retain="30m")
        plain = _conversation(pc, 100_000, 4)
        keys = set(pc.keys(pc.hashes(kept))) | set(pc.keys(pc.hashes(plain)))
        wait_for(lambda: {o.key for o in c.list(namespace="chat", tier="disk")} == keys)
        assert {o.tier for o in c.list(namespace="chat")} == {"dram+disk"}
        assert c.stat().retention.retained_objects == 4  # still retained, still in a pool
