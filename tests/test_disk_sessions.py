"""Sessions beside the disk tier ([tier.disk], issue 42: "retained sessions first to stay in
DRAM"): under pressure the pools demote every unretained object to disk before a session's
retained blocks; released, those blocks go to disk with the next overflow and are still
served from there."""

from __future__ import annotations

import time

from kvbroker.prefix import PrefixCache
from test_sessions import burst, chain, connect, held, make_broker  # noqa: F401 (a fixture)
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


class _WritingBack:
    """The disk tier as the pools see it: what it holds as readers while their copies are
    written (DiskTier.writing_back), and what it is asked to demote."""

    def __init__(self) -> None:
        self.writing_back: set = set()
        self.demoted: list[str] = []

    def demote(self, obj) -> bool:
        self.demoted.append(obj.key)
        return True

    def has(self, ident) -> bool:  # nothing is on disk only here
        return False


def test_the_watermark_waits_for_written_back_objects_rather_than_take_a_retained_one(
    make_broker,  # noqa: F811
):
    """Write-back holds the pools' least recently used objects as readers while their copies
    are written (out of the LRU). A seal above the high watermark then found the LRU empty
    and demoted a session's block, with every unretained object coming back to the LRU a
    moment later (and a demotion refused when the writes in flight use the budget drops it
    outright)."""
    b = make_broker(npages=64)  # high watermark 0.95: 61 pages; low 0.90: 58
    tier = b.pages.tier = _WritingBack()
    s = connect(b)
    kept = chain(b, s, "conv", 8, retain={"session": "conv-1", "for": 600})
    burst(b, s, 50)  # 58 pages: below the high watermark
    for obj in [o for o in b.objects.values() if o.key.startswith("burst")]:
        b.directory.pin(obj)  # as DiskLink.hold does for a write-back
        tier.writing_back.add(obj)
    burst(b, s, 3, prefix="late")  # 61 pages: the 3 in the LRU go, the pool stays at 58
    assert tier.demoted == ["late0", "late1", "late2"]
    assert held(b, kept) == kept
    for obj in list(tier.writing_back):  # the writes end: back in the LRU, oldest first
        tier.writing_back.discard(obj)
        b.directory.unpin_oldest(obj)
    burst(b, s, 4, prefix="next")  # they go first, never the session's blocks
    assert held(b, kept) == kept and not set(kept) & set(tier.demoted)
    assert all(k.startswith(("late", "burst")) for k in tier.demoted)
